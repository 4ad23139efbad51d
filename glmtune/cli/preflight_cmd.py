"""`glmtune preflight RECIPE [--out DIR] [--section.key value ...]`: the ten checks before a real run.

Pins, shards and disk, config/tokenizer/chat template, trainable inventory, one training
step on the data, gradients per path, save/kill/resume, export and reload, base vs trained
outputs, and a multi-process run of the scaled layout (glmtune/preflight/, docs/preflight.md).
Writes OUT/preflight.md and OUT/preflight.json, scratch runs under OUT/work.

Exit status: 0 when all ten checks pass, 1 when any failed or was skipped, 2 for a bad
recipe, override or option (one line). The options may come before or after RECIPE, among
the dotted overrides.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from glmtune.cli.arg_types import RecipeOptions, count_arg

_EXAMPLES = """examples:
  glmtune preflight recipes/tiny/sft_support_json.yaml
  glmtune preflight recipes/tiny/lora_support_json.yaml --out preflight/lora --optim.lr 1e-3
  glmtune preflight recipes/glm5/lora_4k.yaml --model.name_or_path /data/GLM-5 --data.train '[/data/sft.jsonl]'
  glmtune preflight recipes/glm5/lora_4k.yaml --layers 6 --nproc 8 --no-shard-hashes
"""
REPORT_NAME = "preflight.json"


def _layers(text: str) -> str | int:
    if text in ("auto", "all"):
        return text
    try:
        return count_arg(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, all or a number of layers >= 1, got {text!r}") from None


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="report directory (default: <run_dir>-preflight-<time>, beside the recipe's run "
                             "directory); scratch runs go under DIR/work")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier preflight's --out (a directory holding preflight.json)")
    parser.add_argument("--layers", type=_layers, default="auto", metavar="auto|all|K",
                        help="decoder layers checks 5-10 train: auto (for an HF directory or a GLM-5-sized preset "
                             "the fewest leading layers holding every kind of layer; a small preset whole), all, "
                             "or a number")
    parser.add_argument("--nproc", type=count_arg, default=None, metavar="N",
                        help="processes of the multi-process check (default: this host's GPUs; 2 on CPU)")
    parser.add_argument("--rows", type=count_arg, default=64, metavar="N",
                        help="conversations of the recipe's data the scratch runs read (default 64)")
    parser.add_argument("--no-shard-hashes", action="store_true",
                        help="skip hashing shards against the download's recorded sha256 (headers are "
                             "still verified)")


_OPTIONS = RecipeOptions("glmtune preflight", _add_options)


def register(subparsers: argparse._SubParsersAction) -> None:
    _OPTIONS.register(
        subparsers, "preflight",
        help="the ten checks before a real run, with their evidence (preflight.md / .json)",
        description="Check RECIPE (a YAML path or a name under recipes/) before a real run: pins, shards and "
                    "disk, config/tokenizer/chat template, what trains, one step on the data, gradients per "
                    "path, save/kill/resume, export and reload, base vs trained outputs, a multi-process run. "
                    "Exit 0 only when all ten pass.",
        epilog=_EXAMPLES,
        overrides_help="dotted overrides, as glmtune train takes them (--optim.lr 2e-5); the options above may "
                       "appear among them",
        func=_run,
    )


def default_out(run_dir: str) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f"{run_dir.name}-preflight-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_out(out: Path, overwrite: bool, sources: list[tuple[str, Path]]) -> None:
    """Make `out` an empty directory: refuse one that holds anything (any input, always), and with
    `overwrite` remove only an earlier preflight's output."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.outputs import check_output

    check_output(out, kind="dir", overwrite=overwrite, sources=sources, what="--out")
    if overwrite and out.is_dir() and any(out.iterdir()):
        if not (out / REPORT_NAME).is_file():
            raise ValueError(f"--out {out} is not empty and holds no {REPORT_NAME}: it is not an earlier preflight's "
                             "output, and --overwrite replaces only those; choose another directory")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _run(ns: argparse.Namespace) -> int:
    from rich.console import Console

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.preflight.context import Preflight
    from glmtune.preflight.report import exit_status, results_table
    from glmtune.preflight.runner import run_checks

    overrides = _OPTIONS.parse(ns)
    ns.debug = ns.debug or "--debug" in overrides
    overrides = [o for o in overrides if o != "--debug"]
    pf = Preflight(ns.recipe, overrides, ns.out or ".", layers=ns.layers, nproc=ns.nproc, rows=ns.rows)
    if not ns.out:
        pf.out = default_out(pf.cfg.logging.run_dir)
    d = pf.cfg.data
    sources = [("RECIPE", pf.recipe), *((("model.name_or_path", pf.model_dir),) if pf.model_dir else ()),
               *(("data.train", Path(p)) for p in d.train), *(("data.validation", Path(p)) for p in d.validation),
               *((("data.tokenizer", Path(d.tokenizer)),) if d.tokenizer else ())]
    claim_out(pf.out, ns.overwrite, sources)
    console = Console(highlight=False)
    console.print(f"glmtune preflight {pf.recipe} -> {pf.out}")
    results = run_checks(pf, console, hash_shards=not ns.no_shard_hashes)
    console.print(results_table(results))
    status = exit_status(results)
    counts = {s: sum(r.status == s for r in results) for s in ("fail", "skip")}
    verdict = "[green]all ten checks pass[/green]" if status == 0 else \
        f"[red]{counts['fail']} failed, {counts['skip']} skipped[/red]"
    console.print(f"{verdict}; report: {pf.out / 'preflight.md'}, {pf.out / REPORT_NAME}")
    return status
