"""`glmtune eval SUITE --base BASE --candidate CAND [--out DIR]`: a scorecard and release gates.

Both (with --merged all three) models, and each --compare TARGET (reported beside them, never
gated: glmtune/eval/compare.py), answer the suite's sets under one chat template, system prompt and
decoding, one model in memory at a time; the scores, per category with the base's
value, the delta and n, go to DIR/scorecard.{json,md,html} with the suite and the exact rows
(docs/eval.md). Exit status: 0 every gate passed, 1 a gate failed (each failed gate is printed
with its values), 2 a user error (one line: the suite, a row, a model or an option; ValueError
and OSError, which `glmtune.cli.main` turns into it), 3 the evaluation could not finish: an
endpoint that failed every request of a set (`ServerFailed`: the server and its fault kinds) or
an internal error (any other exception), in one line, the traceback only with --debug (or
GLMTUNE_DEBUG=1). CI can thus tell a candidate
that fails its gates from an evaluation that could not finish. One example that fails (its
generation, a tool, a scorer) does not end the run: it is a failed example in the scorecard.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from glmtune.cli.arg_types import DTYPE_CHOICES
from glmtune.io import json_out
from glmtune.io.escape import console_text
from glmtune.io.text_limits import printable

EXIT_PASSED, EXIT_GATE_FAILED, EXIT_USER_ERROR, EXIT_INTERNAL_ERROR = 0, 1, 2, 3  # 2 is printed by glmtune.cli.main

_EPILOG = """exit status:
  0  every gate passed
  1  a gate failed (each failed gate is printed with its values)
  2  a user error: the suite, a row, a model, an option (one line)
  3  the evaluation could not finish: a server failed every request of a set (named, with
     its fault kinds), or an internal error (one line; --debug shows the traceback)

examples:
  glmtune eval recipes/tiny/eval_support_json.yaml --base runs/tiny-sft-support-json \\
      --candidate runs/tiny-sft-support-json
  glmtune eval SUITE.yaml --base /models/GLM-5 --candidate runs/glm5-lora --merged --device cuda
  glmtune eval SUITE.yaml --base B --candidate C --out evals/c --overwrite --json > scorecard.json
  glmtune eval SUITE.yaml --base runs/student --candidate runs/student-distilled \
      --compare runs/teacher/hf,name=teacher --compare https://api.example.com/v1,model=glm-5,key-env=ZAI_KEY
"""

def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a candidate against its base on a suite; exit 1 when a release gate fails, 3 when it crashes",
        description="Run SUITE's test sets on the base and the candidate with the same prompt wrapper and "
                    "decoding, score them (task success, format, tool execution, facts, refusal, general text "
                    "loss, operations), check the suite's release gates and write the scorecard.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", metavar="SUITE", help="suite YAML file (or a name under recipes/)")
    parser.add_argument("--base", required=True, metavar="BASE",
                        help="the base model: an HF directory, a run directory (the model it started from), or a "
                             "server's http(s)://HOST:PORT/v1")
    parser.add_argument("--candidate", required=True, metavar="CAND",
                        help="the candidate: a run directory (its hf/ or adapter/), an HF directory, an adapter, or a "
                             "server's http(s)://HOST:PORT/v1")
    parser.add_argument("--compare", action="append", default=[], metavar="TARGET[,KEY=VALUE...]",
                        help="one more model on the scorecard, reported beside base and candidate and not gated "
                             "(repeatable): an HF directory, a run directory, an adapter, or a server's "
                             "http(s)://HOST:PORT/v1; keys name=LABEL, model=ID, api=completions|chat, key-env=VAR "
                             "(the variable holding the endpoint's API key, written nowhere)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="eval directory to write (default: CAND/eval/<suite name> for a run directory, "
                             "else ./eval/<suite name>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace DIR if it is an earlier glmtune eval output (never anything else, never an "
                             "input; inside a run directory only under RUN/eval/)")
    parser.add_argument("--merged", action="store_true",
                        help="also evaluate an adapter candidate merged into its base (label candidate-merged) "
                             "beside the unmerged adapter (label candidate)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the models run (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="parameter dtype (default: each checkpoint's own)")
    parser.add_argument("--json", action="store_true",
                        help="print the scorecard JSON on stdout instead of the table (progress goes to stderr)")
    sharding = parser.add_argument_group(
        "sharded evaluation", "each model laid out over N ranks as training lays it out (docs/eval.md); also when "
                              "torchrun or srun starts `glmtune eval` itself")
    sharding.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, metavar="N",
                          help="start N processes on this host with torchrun, each loading its shards")
    sharding.add_argument("--parallel.ep", dest="ep", type=int, metavar="EP",
                          help="expert-parallel degree (default: the candidate run's parallel.ep, else 1)")
    sharding.add_argument("--model.fp8_base", dest="fp8_base", choices=("none", "dequant", "triton"),
                          help="keep the models' weights in FP8 as a LoRA run keeps its frozen base "
                               "(default: the candidate run's model.fp8_base, else none)")
    _add_endpoint_options(parser)
    parser.set_defaults(func=_run)


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    served = parser.add_argument_group(
        "endpoint models", "--base / --candidate given as http(s)://HOST:PORT/v1: an OpenAI-compatible server "
                           "(vLLM, SGLang, transformers serve; docs/eval.md, Endpoint evaluation)")
    served.add_argument("--base-model", metavar="ID", help="the served model of an endpoint --base (default: the "
                        "only one GET /v1/models lists)")
    served.add_argument("--candidate-model", metavar="ID", help="the served model of an endpoint --candidate")
    served.add_argument("--api", choices=("completions", "chat"), default=None,
                        help="completions (default): glmtune renders the suite's chat template and parses tool "
                             "calls, as in-process; chat: the engine's template and tool-call parser")
    served.add_argument("--concurrency", type=int, metavar="N", help="requests in flight (default 8)")
    served.add_argument("--timeout", type=float, metavar="S",
                        help="seconds per request attempt, its whole duration (default 120); a request with its "
                             "retries ends within timeout x (retries + 1)")
    served.add_argument("--retries", type=int, metavar="N",
                        help="retries of a request after a 408/429/5xx, a timeout or a lost connection (default 3)")
    served.add_argument("--max-response-bytes", type=int, metavar="B",
                        help="the most bytes read of any one response, larger ones fail their request (default "
                             "16777216, 16 MiB; from 1024 to 1073741824)")
    served.add_argument("--tokenizer", metavar="DIR", help="tokenizer and chat template for the suite's prompts "
                        "when no model is local (default: the local model's)")


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.1%}" if unit == "ratio" else f"{value:g}" if unit == "count" else f"{value:.4g}"


def _delta(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value * 100:+.1f} pt" if unit == "ratio" else f"{value:+.4g}"


def _table(card: dict):
    from rich.table import Table

    labels = [m["label"] for m in card["models"]]
    suite = card["suite"]
    table = Table(title=f"scorecard: {console_text(suite['name'])} v{console_text(suite['version'])} (category all)")
    names = [console_text(label) for label in labels]  # every string from the card is shown as written
    for column in ("metric", "category", "n", *names, *[f"Δ {name}" for name in names[1:]]):
        if column == "metric":
            table.add_column(column, overflow="fold")  # a narrow terminal folds the id, never a number
        else:
            table.add_column(column, justify="left" if column == "category" else "right", no_wrap=True)
    for metric in card["metrics"]:
        entry = metric["by_category"]["all"]
        why = metric.get("not_available", {})  # "not available from this engine: ..." -> "n/a (this engine)"
        values = [_fmt(entry["values"][label], metric["unit"]) if label not in why
                  else f"n/a ({console_text(str(why[label]).split(':')[0].removeprefix('not available from '))})"
                  for label in labels]
        deltas = [_delta(entry["delta"][label], metric["unit"]) for label in labels[1:]]
        table.add_row(console_text(metric["id"]), "all", str(entry["n"]), *values, *deltas)
    return table


def _run(ns: argparse.Namespace) -> int:
    return run_reported(ns, "eval", _evaluate)


def run_reported(ns: argparse.Namespace, command: str, body) -> int:
    """`body(ns)`'s exit status, recorded for the launcher (`_record_status`): a user error is
    re-raised (glmtune.cli.main prints its one line, exit 2); any other failure is one line, exit 3
    ("could not finish" for a server's fault, else "internal error"), its traceback with --debug.
    Shared by `glmtune eval` and `glmtune decide`."""
    try:
        status = body(ns)
    except (ValueError, OSError):
        _record_status(EXIT_USER_ERROR)
        raise  # user errors: glmtune.cli.main prints one line, exit 2
    except Exception as exc:
        # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
        from glmtune.cli import _debug
        from glmtune.eval.endpoint_client import ServerFailed

        _record_status(EXIT_INTERNAL_ERROR)
        if _debug(ns):
            raise
        message = printable(" ".join(str(exc).split())[:1000])
        if isinstance(exc, ServerFailed):  # the server's fault, named with its kinds: not glmtune's
            print(f"glmtune {command}: could not finish: {message}", file=sys.stderr)
            return EXIT_INTERNAL_ERROR
        print(f"glmtune {command}: internal error: {type(exc).__name__}: {message} (run with --debug for the "
              "traceback)", file=sys.stderr)
        return EXIT_INTERNAL_ERROR
    _record_status(status)
    return status


def _record_status(status: int) -> None:
    """Rank 0 of a sharded evaluation started by `--nproc-per-node` tells the launcher its exit status."""
    if os.environ.get(_STATUS_FILE) and os.environ.get("RANK", "0") == "0":
        Path(os.environ[_STATUS_FILE]).write_text(str(status))


def launch_on_ranks(ns: argparse.Namespace, command: str = "eval") -> int:
    """`--nproc-per-node N`: the same command on N ranks; the exit status is rank 0's (written to a
    file the ranks are told of), not torchrun's 0-or-1. `command`: eval, or decide (which runs on its ranks
    the same way)."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.cli import _debug
    from glmtune.distributed.launch import NPROC_FLAGS, pop_nproc_per_node, run_command_on_ranks

    if ns.nproc_per_node < 2:
        raise ValueError(f"--nproc-per-node must be >= 2 for a sharded evaluation, got {ns.nproc_per_node}")
    args, _ = pop_nproc_per_node(ns.argv[ns.argv.index(command) + 1:])
    assert not any(a.split("=")[0] in NPROC_FLAGS for a in args)
    with tempfile.TemporaryDirectory(prefix=f"glmtune-{command}-") as tmp:
        status_file = Path(tmp) / "status"
        os.environ[_STATUS_FILE] = str(status_file)
        try:
            status = run_command_on_ranks(ns.nproc_per_node, command, args, debug=_debug(ns))
        finally:
            del os.environ[_STATUS_FILE]
        return int(status_file.read_text()) if status_file.is_file() else status


_STATUS_FILE = "GLMTUNE_EVAL_STATUS_FILE"


def _evaluate(ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.eval.compare import compare_targets
    from glmtune.eval.placement import check_device

    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # a device this machine lacks: one line before the suite, a model or torchrun is touched
    check_device(ns.device, sharded=sharded or ns.nproc_per_node is not None, command="eval")
    if ns.nproc_per_node is not None:
        compare_targets(ns.compare, sharded=True)  # refused (one line) before torchrun starts
        return launch_on_ranks(ns)
    if not sharded and ns.ep not in (None, 1):
        raise ValueError(f"--parallel.ep {ns.ep} splits experts over ranks: add --nproc-per-node N (or start "
                         "`glmtune eval` with torchrun)")
    import torch
    from rich.console import Console

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.eval.evaluate import run_eval
    from glmtune.eval.sharded import ShardedLayout

    main_rank = int(os.environ.get("RANK", "0")) == 0
    progress = Console(stderr=True, highlight=False, quiet=not main_rank)
    dtype = None if ns.dtype == "auto" else getattr(torch, ns.dtype)
    card, out = run_eval(ns.suite, ns.base, ns.candidate, ns.out, overwrite=ns.overwrite, device=ns.device,
                         dtype=dtype, merged=ns.merged, log=lambda message: progress.print(console_text(message)),
                         sharded=ShardedLayout(ns.ep, ns.fp8_base) if sharded else None,
                         fp8_base=ns.fp8_base or "none", endpoint=_endpoint_options(ns), compare=ns.compare)
    return _report(ns, card, out) if main_rank else EXIT_PASSED


def _endpoint_options(ns: argparse.Namespace):
    # lazily: `glmtune --help` stays torch-free (evaluate's imports are already loaded here)
    from glmtune.eval.endpoint import EndpointOptions

    return EndpointOptions(ns.api, ns.concurrency, ns.timeout, ns.retries, ns.base_model, ns.candidate_model,
                           Path(ns.tokenizer) if ns.tokenizer is not None else None, ns.max_response_bytes)


def _report(ns: argparse.Namespace, card: dict, out: Path) -> int:
    """The scorecard on stdout (a table, or --json), failed gates named; the exit status."""
    from rich.console import Console

    progress = Console(stderr=True, highlight=False)
    failed = [g for g in card["gates"] if not g["passed"]]
    if ns.json:
        # ASCII: no C1 control or bidi override reaches a terminal as itself; RFC 8259: NaN as "NaN"
        sys.stdout.write(json_out.dumps(card))
        sys.stdout.write("\n")
        for gate in failed:  # stdout holds only the JSON: say on stderr why the exit status is 1
            progress.print(f"gate failed: {console_text(gate['name'])}: {console_text(gate['message'])}")
    else:
        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 132  # a log or a pipe: room for the ids and every model's column
        console.print(_table(card))
        for gate in card["gates"]:
            mark = "[green]PASS[/green]" if gate["passed"] else "[red]FAIL[/red]"
            console.print(f"{mark} {console_text(gate['name'])}: {console_text(gate['message'])}")
        console.print(f"report: {console_text(out / 'scorecard.html')} (also scorecard.md, scorecard.json)")
    return EXIT_GATE_FAILED if failed else EXIT_PASSED
