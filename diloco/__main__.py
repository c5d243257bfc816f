"""``python -m diloco COMMAND ...`` == ``diloco COMMAND ...``."""

import sys

from diloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
