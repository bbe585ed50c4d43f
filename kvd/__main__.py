"""``python -m kvd`` = the ``kvd`` console script."""

import sys

from kvd.cli import main

sys.exit(main())
