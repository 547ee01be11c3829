"""`python -m tracker` is `protocol-tracker`."""

import sys

from tracker.cli import main

sys.exit(main())
