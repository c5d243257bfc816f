"""``python -m learner``: the same as ``diloco learner`` (configured by DILOCO_* variables)."""

import sys

from bus.entry import run_command
from learner.service import main

if __name__ == "__main__":
    sys.exit(run_command("learner", main, sys.argv[1:]))
