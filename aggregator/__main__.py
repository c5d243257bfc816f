"""``python -m aggregator`` == ``diloco aggregator``."""

import sys

from aggregator.service import main

sys.exit(main())
