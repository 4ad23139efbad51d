"""`glmtune train RECIPE [--section.key value ...]`: run a training recipe.

Exit status: 0 done, 2 bad recipe, data or run directory (one-line message), 3
stopped on a non-finite loss (last good checkpoint kept), 130 interrupted by
SIGTERM/SIGINT (after saving a checkpoint when training had started).

Flags among the overrides: `--overwrite` replaces an earlier run in the same run
directory (its checkpoints and outputs); `--debug` shows tracebacks.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a recipe (SFT or LoRA)",
        description="Load RECIPE (a YAML path or a name under recipes/, e.g. tiny/sft_support_json), apply "
                    "dotted overrides, check the data contract, train, checkpoint and export. "
                    "Resume a stopped run with --checkpoint.resume auto.",
    )
    parser.add_argument("recipe", help="recipe YAML file or name under recipes/")
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="dotted overrides: --optim.lr=2e-5 or --optim.lr 2e-5; also --overwrite (replace an "
                             "earlier run in the run directory: its checkpoints and outputs) and --debug")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from glmtune.config import load_config
    from glmtune.train.run import run_training

    # The flags sit among the dotted overrides (argparse hands everything after RECIPE over).
    overrides = [o for o in args.overrides if o not in _FLAGS]
    overwrite = "--overwrite" in args.overrides
    args.debug = args.debug or "--debug" in args.overrides
    cfg = load_config(args.recipe, overrides)
    return run_training(cfg, overwrite=overwrite)


_FLAGS = ("--overwrite", "--debug")
