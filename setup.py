"""Package layout only; everything else is in pyproject.toml.

The launchd and systemd templates stay in systemd_launchd/ at the top of the source tree (where
people look for them) and are shipped inside the package as ``meshnode.service_templates``, so
that ``meshnode install`` from a built wheel finds them (see meshnode/service.py). pyproject.toml
cannot map a folder outside the package into it while also finding the packages, hence this file.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[*find_namespace_packages(include=["meshnode*"]), "meshnode.service_templates"],
    package_dir={"meshnode.service_templates": "systemd_launchd"},
)
