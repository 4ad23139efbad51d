"""`python -m glmtune` is the same as the `glmtune` command."""

import sys

from glmtune.cli import main

sys.exit(main())
