"""``python -m pytest_dflash.cli``: the same as the ``pytest-dflash`` command."""

import sys

from pytest_dflash.cli import main

sys.exit(main())
