"""``python -m meshnode.cli``: the ``meshnode`` command."""

import sys

from meshnode.cli import main

sys.exit(main())
