"""``python -m sparsehi`` = the ``sparsehi`` console script."""
import sys

from sparsehi.cli import main

sys.exit(main())
