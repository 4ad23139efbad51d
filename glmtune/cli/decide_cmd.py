"""`glmtune decide SUITE --base MODEL [...]`: should this be fine-tuned at all?

The suite answered, scored and gated (as `glmtune eval` does) in arms: the base as it is; the base
prompted with k examples from the training data (`--examples`); the base with passages retrieved
from the user's documents (`--docs`); each alternative (`--compare`: an API, a smaller model, a
trained run). A verdict by written rules (docs/decide.md) and, with `--recipe`, the training run's
cost from `glmtune plan`; the decision directory holds decision.{json,md,html}. Exit status: 0 no
training needed (the base, prompting, retrieval or an alternative passes every gate), 1 fine-tune
(or combine arms first: no arm passes every gate), 2 a user error (one line; `glmtune.cli.main`),
3 the run could not finish (a server that failed every request of a set, or an internal error).
With `--nproc-per-node N` the same command runs on N ranks (eval's launcher), each local model laid
out over them; the exit status is rank 0's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from glmtune.cli.arg_types import DTYPE_CHOICES
from glmtune.cli.eval_cmd import launch_on_ranks, run_reported  # eval's launcher: the same on N ranks, rank 0's status
from glmtune.io import json_out
from glmtune.io.escape import console_text

EXIT_NO_TRAINING, EXIT_FINE_TUNE, EXIT_USER_ERROR, EXIT_COULD_NOT_FINISH = 0, 1, 2, 3

_EPILOG = """exit status:
  0  no training needed: the base, prompting, retrieval or an alternative passes every gate
  1  fine-tune: gates fail in every arm (or no arm passes every gate: combine them first)
  2  a user error: the suite, a row, a model, an option, the documents (one line)
  3  the run could not finish: a server failed every request of a set (named, with its fault
     kinds), or an internal error (one line; --debug shows the traceback)

--compare TARGET[,name=LABEL][,model=ID][,api=completions|chat][,key-env=VAR][,cost-per-1k=USD]
  TARGET: http(s)://HOST:PORT/v1 (an API or a served smaller model), or an HF, run or adapter
  directory. key-env names the environment variable holding the API key (never written anywhere).

examples:
  glmtune decide recipes/tiny/eval_decide_support_json.yaml --base runs/tiny-sft-support-json \\
      --examples runs/tiny-sft-support-json --docs recipes/tiny/support_docs \\
      --compare runs/tiny-sft-support-json,name=trained
  glmtune decide SUITE.yaml --base /models/GLM-5 --examples train.jsonl --docs kb/ \\
      --compare https://api.example.com/v1,model=small,api=chat,key-env=EXAMPLE_KEY,cost-per-1k=0.4 \\
      --recipe recipes/glm5/lora_4k.yaml --throughput runs/pilot --price-per-gpu-hour 2.5
"""


def _add_arms(parser: argparse.ArgumentParser) -> None:
    prompted = parser.add_argument_group("prompted arm", "the base with k examples of the training data before "
                                                         "each prompt")
    prompted.add_argument("--examples", metavar="DATA", help="training data: a run directory (its training split), "
                          "JSONL/Parquet files or a folder of them; rows from the eval set's groups are refused")
    prompted.add_argument("--shots", type=int, metavar="K", help="examples per prompt (default 3)")
    prompted.add_argument("--shots-by", metavar="HOW", help="fixed (default): the first K rows, the same for every "
                          "prompt; nearest: the K rows nearest each prompt by BM25")
    retrieval = parser.add_argument_group("retrieval arm", "the base with passages of your documents, retrieved "
                                                           "by BM25, in the prompt")
    retrieval.add_argument("--docs", metavar="DIR", help="folder of .txt, .md and .jsonl ({\"text\": ...}) documents")
    retrieval.add_argument("--passages", type=int, metavar="K", help="passages per prompt (default 3)")
    retrieval.add_argument("--chunk-words", type=int, metavar="W", help="words per chunk (default 120)")
    retrieval.add_argument("--chunk-overlap", type=int, metavar="O", help="words two windows of a long paragraph "
                           "share (default 20)")
    retrieval.add_argument("--retriever", metavar="HOW", help="bm25 (default), or embeddings:DIR: a local "
                           "transformers model directory (mean-pooled last hidden states, cosine; never downloaded)")
    parser.add_argument("--compare", action="append", default=[], metavar="TARGET[,KEY=VALUE...]",
                        help="an alternative (repeatable): an endpoint or a local model, with options (below)")


def _add_endpoint_and_cost(parser: argparse.ArgumentParser) -> None:
    served = parser.add_argument_group("endpoints", "--base or a --compare given as http(s)://HOST:PORT/v1 "
                                                    "(docs/eval.md, Endpoint evaluation)")
    served.add_argument("--base-model", metavar="ID", help="the served model of an endpoint --base")
    served.add_argument("--base-key-env", metavar="VAR", help="environment variable holding an endpoint --base's "
                        "API key (never written anywhere)")
    served.add_argument("--api", choices=("completions", "chat"), default=None, help="an endpoint --base's API "
                        "(default completions)")
    served.add_argument("--concurrency", type=int, metavar="N", help="requests in flight per endpoint (default 8)")
    served.add_argument("--timeout", type=float, metavar="S", help="seconds per request attempt (default 120)")
    served.add_argument("--retries", type=int, metavar="N", help="retries after a 408/429/5xx, a timeout or a lost "
                        "connection (default 3)")
    served.add_argument("--max-response-bytes", type=int, metavar="B", help="the most bytes read of one response "
                        "(default 16 MiB)")
    served.add_argument("--tokenizer", metavar="DIR", help="tokenizer and chat template when no model is local")
    cost = parser.add_argument_group("the training alternative's cost", "the plan of a recipe (glmtune plan, "
                                                                         "docs/plan.md) beside the verdict")
    cost.add_argument("--recipe", metavar="RECIPE", help="the training run that would be made")
    cost.add_argument("--throughput", metavar="SRC", help="a measured run: RUN_DIR, its metrics.jsonl, or a "
                      "benchmark's JSON lines")
    cost.add_argument("--tflops-per-gpu", type=float, metavar="X", help="a measured model TFLOP/s per GPU instead")
    cost.add_argument("--measured-gpu", metavar="GPU", help="the GPU --tflops-per-gpu was measured on")
    cost.add_argument("--gpu", action="append", default=[], metavar="GPU",
                      help="GPU kind to price (repeatable: h100-80g, h200-141g, b200-180g, a100-80g; default the "
                           "first two)")
    cost.add_argument("--price-per-gpu-hour", type=float, metavar="P", help="price of one GPU-hour")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "decide", help="before training: do the base, prompting, retrieval or an alternative already pass the "
                       "gates? exit 1 when only fine-tuning is left",
        description="Score SUITE in arms under one prompt wrapper and decoding (the base; prompted with examples; "
                    "with retrieved passages; alternatives), check the suite's gates in every arm, give the verdict "
                    "by written rules (docs/decide.md) and the training run's cost, and write the decision.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", metavar="SUITE", help="suite YAML file (or a name under recipes/), with gates")
    parser.add_argument("--base", required=True, metavar="MODEL", help="the model to decide about: an HF directory, a "
                        "run directory (the model it started from), or a server's http(s)://HOST:PORT/v1")
    parser.add_argument("--out", metavar="DIR", default=None, help="decision directory (default ./decide/<suite name>)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it is an earlier glmtune decide "
                        "output (never anything else, never an input)")
    _add_arms(parser)
    _add_endpoint_and_cost(parser)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where local models run (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="parameter dtype (default: each "
                        "checkpoint's own)")
    parser.add_argument("--json", action="store_true", help="print decision.json on stdout instead of the tables")
    sharding = parser.add_argument_group(
        "sharded decision", "each local model laid out over N ranks as training lays it out (as glmtune eval's, "
                            "docs/eval.md); also when torchrun or srun starts `glmtune decide` itself")
    sharding.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, metavar="N",
                          help="start N processes on this host with torchrun, each loading its shards")
    sharding.add_argument("--parallel.ep", dest="ep", type=int, metavar="EP",
                          help="expert-parallel degree (default: the base run's parallel.ep, else 1)")
    sharding.add_argument("--model.fp8_base", dest="fp8_base", choices=("none", "dequant", "triton"),
                          help="keep the models' weights in FP8 as a LoRA run keeps its frozen base")
    parser.set_defaults(func=_run)


def _run(ns: argparse.Namespace) -> int:
    # eval's guard: a user error exits 2, any other failure one line and 3; rank 0's status recorded
    return run_reported(ns, "decide", _launch_or_decide)


def _launch_or_decide(ns: argparse.Namespace) -> int:
    """In this process, or on N ranks started here (`--nproc-per-node`), once the device is one
    this machine has (`check_device`: before torchrun starts anything)."""
    if ns.nproc_per_node is None:
        return _decide(ns)  # DecideOptions.check refuses the device before anything is read
    # lazily: `glmtune --help` stays torch-free
    from glmtune.decide.run import check_device

    check_device(ns.device, sharded=True)
    return launch_on_ranks(ns, "decide")


def _options(ns: argparse.Namespace):
    import torch

    # lazily: `glmtune --help` stays torch-free
    from glmtune.decide.cost import CostOptions
    from glmtune.decide.run import DecideOptions
    from glmtune.eval.endpoint import EndpointOptions
    from glmtune.eval.sharded import ShardedLayout

    endpoint = EndpointOptions(ns.api, ns.concurrency, ns.timeout, ns.retries, ns.base_model, None,
                               Path(ns.tokenizer) if ns.tokenizer is not None else None, ns.max_response_bytes)
    cost = CostOptions(ns.recipe, ns.throughput, ns.tflops_per_gpu, ns.measured_gpu, list(ns.gpu),
                       ns.price_per_gpu_hour)
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not sharded and (ns.ep is not None or ns.fp8_base is not None):
        raise ValueError(f"{'--parallel.ep' if ns.ep is not None else '--model.fp8_base'} lays the models out over "
                         "ranks: add --nproc-per-node N (or start `glmtune decide` with torchrun)")
    return DecideOptions(ns.suite, ns.base, ns.out, ns.overwrite, ns.examples, ns.shots, ns.shots_by, ns.docs,
                         ns.passages, ns.chunk_words, ns.chunk_overlap, list(ns.compare), ns.base_key_env, endpoint,
                         ns.device, None if ns.dtype == "auto" else getattr(torch, ns.dtype), cost,
                         ShardedLayout(ns.ep, ns.fp8_base) if sharded else None, ns.retriever)


def _decide(ns: argparse.Namespace) -> int:
    from rich.console import Console

    # lazily: `glmtune --help` stays torch-free
    from glmtune.decide.run import run_decide

    progress = Console(stderr=True, highlight=False)
    options = _options(ns)
    decision, out = run_decide(options, log=lambda message: progress.print(console_text(message)))
    if decision is None:  # a rank other than 0 of a sharded decision: rank 0 reports
        return EXIT_NO_TRAINING
    if ns.json:
        sys.stdout.write(json_out.dumps(decision) + "\n")
    else:
        _print(decision, out)
    return decision["verdict"]["exit_code"]


def _print(decision: dict, out) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 132
    card = decision["scorecard"]
    labels = [a["label"] for a in decision["arms"]]
    table = Table(title=f"decide: {console_text(card['suite']['name'])} v{console_text(card['suite']['version'])}: "
                        "each gate in each arm")
    table.add_column("gate", overflow="fold")
    for label in labels:
        table.add_column(console_text(label), justify="right")
    units = {m["id"]: m["unit"] for m in card["metrics"]}
    rows: dict[str, dict[str, str]] = {}
    for g in card["gates"]:
        value = g["value"]
        shown = "—" if value is None else f"{value:.1%}" if units.get(g["metric"]) == "ratio" else f"{value:.4g}"
        rows.setdefault(g["name"], {})[g["model"]] = f"{shown} {'pass' if g['passed'] else '[red]FAIL[/red]'}"
    for name, cells in rows.items():
        table.add_row(console_text(name), *[cells[label] for label in labels])
    console.print(table)
    for arm in decision["arms"]:
        console.print(f"{console_text(arm['label'])}: {console_text(arm['how'])}")
    verdict = decision["verdict"]
    console.print(f"[bold]verdict[/bold]: {console_text(verdict['text'])} (rule {console_text(verdict['rule'])})")
    for line in verdict["cost"]:
        console.print(console_text(line))
    console.print(f"report: {console_text(out / 'decision.html')} (also decision.md, decision.json)")
