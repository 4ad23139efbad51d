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
import os
from pathlib import Path

from glmtune.config import RECIPES_DIR, JobConfig, load_config
from glmtune.io.interrupts import interrupts_deferred
from glmtune.models.catalog import is_preset  # torch-free, as the config package


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
    # Held: a Ctrl-C inside these imports (torch's and triton's C++ call back into Python) would abort
    # the process, a rank of a launched run included; it is raised once they are done (io/interrupts.py).
    with interrupts_deferred():  # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
        from glmtune.distributed.launch import launch_torchrun, pop_nproc_per_node
        from glmtune.models.registry import model_dims

    # The flags sit among the dotted overrides (argparse hands everything after RECIPE over).
    debug_before_train = args.debug  # `glmtune --debug train ...`: the ranks need it too
    args.debug = args.debug or "--debug" in args.overrides
    passed_on, nproc = pop_nproc_per_node(args.overrides)
    overrides = [o for o in passed_on if o not in _FLAGS]
    cfg = load_config(args.recipe, overrides)
    refuse_a_model_not_made_yet(cfg, args.recipe)
    if nproc is not None:
        return launch_torchrun(cfg, nproc, [args.recipe, *passed_on], model_dims(cfg.model), debug=debug_before_train)

    with interrupts_deferred():  # lazily (torch-free --help) and held, as above
        from glmtune.train.run import run_training

    status = run_training(cfg, overwrite="--overwrite" in args.overrides)
    if status == 0 and os.environ.get("RANK", "0") == "0":  # rank 0 of torchrun, or the one process
        write_run_cards(cfg)
    return status


def write_run_cards(cfg: JobConfig) -> None:
    """A model card (README.md, docs/release.md "The model card") in each export the run writes
    itself: RUN_DIR/hf for full fine-tuning, RUN_DIR/adapter and adapter_per_expert for LoRA; the
    card `glmtune export` would write for the same checkpoint."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.cli.export_cmd import run_base_dir
    from glmtune.peft.adapter_export import RUN_DIRS
    from glmtune.release.model_card import write_run_card

    run_dir = Path(cfg.logging.run_dir)
    if cfg.peft.method == "lora":
        exports = [(run_dir / sub, run_base_dir(cfg, run_dir), "adapter") for sub in RUN_DIRS.values()]
    else:
        exports = [(run_dir / "hf", run_dir / "hf", "hf")] if cfg.checkpoint.export_hf else []
    for out, model_dir, kind in exports:
        if out.is_dir():
            print(f"wrote the model card {write_run_card(run_dir, out, model_dir, kind)}")


_FLAGS = ("--overwrite", "--debug")


def refuse_a_model_not_made_yet(cfg: JobConfig, recipe: str) -> None:
    """A recipe that continues from another bundled recipe's run (the DPO demo from the SFT demo's `hf/`)
    names that run's output as its model: before that run has been made, say so and give the command
    that makes it, rather than "neither a preset nor an existing path"."""
    source = Path(cfg.model.name_or_path)
    if is_preset(cfg.model.name_or_path) or source.exists():
        return
    makefile = RECIPES_DIR.parent / "Makefile"
    for path in sorted(RECIPES_DIR.glob("*/*.yaml")):
        try:
            other = load_config(path)
        except ValueError:  # an evaluation suite, not a training recipe
            continue
        run_dir = Path(other.logging.run_dir).resolve()
        if run_dir == source.resolve() or run_dir in source.resolve().parents:
            command = f"glmtune train {path.relative_to(RECIPES_DIR.parent)}"
            demo = makefile.is_file() and command in makefile.read_text()
            raise ValueError(
                f"{cfg.model.name_or_path} does not exist yet: {recipe} continues from the model that "
                f"{other.name}'s run writes there; make it first with `{'make demo` (or `' if demo else ''}{command}`"
                f"{')' if demo else ''}, then run this again")
