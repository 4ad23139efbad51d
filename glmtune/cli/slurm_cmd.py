"""`glmtune slurm RECIPE --nodes N`: write the sbatch script of a multi-node run and submit it.

    glmtune slurm recipes/glm5/sft_4k.yaml --nodes 32 --partition gpu --time 2-00:00:00 \\
        --model.name_or_path /data/GLM-5 --data.train '[/data/sft/train.jsonl]'
    glmtune slurm recipes/glm5/sft_4k.yaml --nodes 32 --dry-run > job.sh   # print it; write nothing

The recipe (with the dotted overrides, which also reach every rank) is validated for
nodes x gpus-per-node ranks before anything is written or submitted; a refusal is one
line and exit status 2. The script goes to <run_dir>/slurm/<time>-sbatch.sh, next to
the job's logs, and never over another file. What it runs, and how a job stops, saves
and requeues itself before its time limit: glmtune/distributed/slurm.py, docs/slurm.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from glmtune.cli.arg_types import RecipeOptions, count_arg as _count

_EXAMPLES = """examples:
  glmtune slurm recipes/glm5/sft_4k.yaml --nodes 32 --partition gpu --time 24:00:00 --dry-run
  glmtune slurm tiny/sft_support_json --nodes 2 --gpus-per-node 4 --train.max_steps 100
"""


def _add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_count, help="number of nodes (required); one torchrun on each")
    parser.add_argument("--gpus-per-node", type=_count, metavar="G",
                        help="GPUs (ranks) per node (default: the recipe's parallel.gpus_per_node)")
    parser.add_argument("--partition", help="sbatch --partition")
    parser.add_argument("--time", help="sbatch --time, the time limit (HH:MM:SS, D-HH:MM, ...)")
    parser.add_argument("--account", help="sbatch --account")
    parser.add_argument("--job-name", metavar="J", help="sbatch --job-name (default: the recipe's name)")
    parser.add_argument("--signal-lead", type=int, default=600, metavar="SECONDS",
                        help="ask the training to save and stop this long before the time limit; it must cover "
                             "one step and one checkpoint (default: 600)")
    parser.add_argument("--rdzv-port", type=int, default=29500, metavar="PORT",
                        help="torchrun's rendezvous port on the first node (default: 29500)")
    parser.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")


_OPTIONS = RecipeOptions("glmtune slurm", _add_flags)


def register(subparsers: argparse._SubParsersAction) -> None:
    _OPTIONS.register(
        subparsers, "slurm",
        help="write and submit the sbatch script of a multi-node run",
        description="Validate RECIPE for nodes x gpus-per-node ranks, write a complete sbatch script to "
                    "<run_dir>/slurm/ (srun: one torchrun per node, c10d rendezvous on the first node, "
                    "--checkpoint.resume auto; saves and requeues itself before the time limit) and submit it "
                    "with sbatch, or print it with --dry-run.",
        epilog=_EXAMPLES,
        overrides_help="dotted overrides for every rank (--optim.lr=2e-5 or --optim.lr 2e-5); also --debug",
        func=_run,
    )


def _refuse_flags_a_requeue_breaks(overrides: list[str]) -> None:
    for index, token in enumerate(overrides):
        name, inline, value = token.partition("=")
        if name == "--overwrite":
            raise ValueError("--overwrite: every requeue of the job would remove the checkpoints it has written; "
                             "start over with `glmtune train ... --overwrite` or choose another --logging.run_dir")
        if name in ("--nproc-per-node", "--nproc_per_node"):
            raise ValueError(f"{name}: the job starts one torchrun per node itself; use --gpus-per-node")
        if name == "--checkpoint.resume":
            if not inline:
                value = overrides[index + 1] if index + 1 < len(overrides) else ""
            if value != "auto":
                raise ValueError(f"--checkpoint.resume {value}: the job passes --checkpoint.resume auto, so that "
                                 "a requeued job continues from its own latest checkpoint; drop the override")


def _run(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.config import load_config, resolve_recipe_path
    from glmtune.distributed.slurm import SlurmJob, check_job, check_slurm_launch, sbatch_script, write_script
    from glmtune.models.registry import model_dims

    overrides = _OPTIONS.parse(args)
    if args.nodes is None:
        raise ValueError("--nodes is required: the number of nodes to run on")
    _refuse_flags_a_requeue_breaks(overrides)
    if args.debug and "--debug" not in overrides:  # `glmtune --debug slurm ...`: the ranks show tracebacks too
        overrides.append("--debug")
    cfg = load_config(args.recipe, [o for o in overrides if o != "--debug"])
    gpus_per_node = check_slurm_launch(cfg, args.nodes, args.gpus_per_node, model_dims(cfg.model))
    job = SlurmJob(
        recipe=str(resolve_recipe_path(args.recipe).resolve()), train_args=overrides,
        run_dir=Path(cfg.logging.run_dir).absolute(), workdir=Path.cwd(), nodes=args.nodes,
        gpus_per_node=gpus_per_node, job_name=args.job_name or cfg.name, partition=args.partition,
        time=args.time, account=args.account, signal_lead=args.signal_lead, rdzv_port=args.rdzv_port,
    )
    check_job(job)
    text = sbatch_script(job)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ValueError("sbatch is not on PATH (not a Slurm login node?); --dry-run prints the script instead")
    path = write_script(job.run_dir, text)
    print(f"wrote {os.path.relpath(path)}")
    done = subprocess.run([sbatch, str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}").splitlines()[-1]
        raise ValueError(f"sbatch refused {path}: {said}")
    print(done.stdout.strip())
    return 0
