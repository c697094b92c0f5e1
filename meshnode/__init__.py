"""meshnode: run one large language model across the machines of a home lab."""

__version__ = "0.1.0"
