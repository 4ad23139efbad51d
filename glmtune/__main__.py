"""`python -m glmtune` is the same as the `glmtune` command."""

from glmtune.cli import run

run()
