"""`python -m promptfcl` = the `promptfcl` console script."""

import sys

from promptfcl.cli import main

sys.exit(main())
