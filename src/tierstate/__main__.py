"""``python -m tierstate``: the same command line as the ``tierstate`` script."""
import sys

from tierstate.cli import main

sys.exit(main())
