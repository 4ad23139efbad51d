"""`python -m glmtune` is the same as the `glmtune` command."""

import os
import sys

try:
    from glmtune.cli import run

    run()
except KeyboardInterrupt:
    # A Ctrl-C after glmtune.cli was imported but before `run()` took over (a few bytecodes; seen
    # under load when the signal came as the import finished): the command had not started.
    sys.stderr.write("glmtune: interrupted\n")
    sys.stderr.flush()
    os._exit(130)
