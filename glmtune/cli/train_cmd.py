"""`glmtune train RECIPE [--section.key value ...]`: run a training recipe.

Exit status: 0 done, 2 bad recipe, data or run directory (one-line message), 3
stopped on a non-finite loss (last good checkpoint kept), 130 interrupted by
SIGTERM/SIGINT (after saving a checkpoint when training had started).

Flags among the overrides: `--overwrite` replaces an earlier run in the same run
directory (exactly what that run created: its checkpoints, also in a shared
checkpoint.dir, and its outputs; a directory holding no glmtune run is refused, see
glmtune/train/run_dir.py); `--debug` shows tracebacks;
`--nproc-per-node N` starts N processes on this host with torchrun, each running the
same command without it (glmtune/distributed/launch.py; exit status is torchrun's).
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
                             "earlier run in the run directory: only its checkpoints and outputs), --debug, and "
                             "--nproc-per-node N (start N processes on this host with torchrun)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.config import load_config
    from glmtune.distributed.launch import launch_torchrun, pop_nproc_per_node
    from glmtune.models.registry import model_dims

    # The flags sit among the dotted overrides (argparse hands everything after RECIPE over).
    debug_before_train = args.debug  # `glmtune --debug train ...`: the ranks need it too
    args.debug = args.debug or "--debug" in args.overrides
    passed_on, nproc = pop_nproc_per_node(args.overrides)
    overrides = [o for o in passed_on if o not in _FLAGS]
    cfg = load_config(args.recipe, overrides)
    if nproc is not None:
        return launch_torchrun(cfg, nproc, [args.recipe, *passed_on], model_dims(cfg.model), debug=debug_before_train)

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.train.run import run_training

    return run_training(cfg, overwrite="--overwrite" in args.overrides)


_FLAGS = ("--overwrite", "--debug")
