"""`python -m sparseflow`: the same command line as the `sparseflow` script."""

import sys

from sparseflow._script import script

sys.exit(script())
