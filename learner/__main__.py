"""``python -m learner``: the same as ``diloco learner`` (configured by DILOCO_* variables)."""

import sys

from bus.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
