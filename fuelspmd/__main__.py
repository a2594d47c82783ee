"""``python -m fuelspmd``: the same as the ``fuelspmd`` command."""

import sys

from fuelspmd.cli import main

if __name__ == "__main__":
    sys.exit(main())
