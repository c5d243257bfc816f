"""``python -m monitor`` runs the membership monitor, exactly like ``diloco monitor``."""

import sys

from monitor.service import main

if __name__ == "__main__":
    sys.exit(main())
