"""``python -m commd.cli ARGS`` = ``commd ARGS``."""

import sys

from commd.cli.main import main

sys.exit(main())
