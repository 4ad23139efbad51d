"""`glmtune train RECIPE [--section.key value ...]`: run a training recipe.

Exit status: 0 done, 2 bad recipe or data (one-line message), 3 stopped on a
non-finite loss (last good checkpoint kept), 130 interrupted by SIGTERM/SIGINT
after saving a checkpoint.
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
                        help="dotted overrides: --optim.lr=2e-5 or --optim.lr 2e-5")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from glmtune.config import load_config
    from glmtune.train.run import run_training

    cfg = load_config(args.recipe, args.overrides)
    return run_training(cfg)
