"""`glmtune distill generate`: a teacher's answers (and top-K log-probabilities) to a dataset's prompts.

  glmtune distill generate DATA... --out DIR --teacher http://HOST:PORT/v1 --tokenizer TOK [--top-logprobs K]
  glmtune distill generate DATA... --out DIR --teacher MODEL_DIR_OR_RUN [--top-logprobs K]

Rerun the same command to resume: the rows done are skipped, the failed ones asked again.
Exit status 0 when every prompt is done or rejected, 3 when some failed (rerun to retry them),
2 for a usage error. docs/distill.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_EXIT_INCOMPLETE = 3


def _generate(args: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.distill.run import GenerateOptions, run_generate
    from glmtune.eval.endpoint_source import EndpointOptions
    from glmtune.eval.suite import DecodingConfig

    decoding = DecodingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    endpoint = EndpointOptions(concurrency=args.concurrency, timeout_s=args.timeout, retries=args.retries,
                               max_response_bytes=args.max_response_bytes, api_key_env=args.api_key_env)
    options = GenerateOptions(
        data=[Path(p) for p in args.data], out=Path(args.out), teacher=args.teacher, teacher_model=args.teacher_model,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None, api=args.api, top_logprobs=args.top_logprobs,
        samples=args.samples, keep_if=Path(args.keep_if) if args.keep_if else None, decoding=decoding,
        endpoint=endpoint, rate_limit=args.rate_limit, token_ids=not args.no_token_ids,
        logprob_dtype=args.logprob_dtype, batch_size=args.batch_size, device=args.device,
        enable_thinking=args.enable_thinking, keep_truncated=args.keep_truncated)
    counts = run_generate(options, log=print)
    print(f"{counts['done']} rows done, {counts['rejected']} rejected, {counts['failed']} failed "
          f"of {counts['prompts']} prompts: {Path(args.out) / 'rows.jsonl'}"
          + (f" (top-K log-probabilities: {Path(args.out) / 'topk'})" if args.top_logprobs else ""))
    if counts["failed"]:
        reasons = ", ".join(f"{why} x{n}" for why, n in counts["failures"].items())
        print(f"glmtune distill generate: could not finish: {counts['failed']} prompts failed ({reasons}; first: "
              f"{counts['failed_examples'][0] if counts['failed_examples'] else '-'}); rerun the same command to "
              "retry them", file=sys.stderr)
        return _EXIT_INCOMPLETE
    return 0


def _add_generate(actions: Any) -> None:
    p = actions.add_parser("generate", help="a teacher's answers to a dataset's prompts, with top-K log-probs",
                           description=__doc__.splitlines()[0])
    p.add_argument("data", nargs="+", metavar="DATA", help="chat rows (their prompts: up to the last assistant turn) "
                   "or prompt rows {prompt, system?, tools?, id?}: .jsonl/.parquet files or folders")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (a rerun resumes it)")
    p.add_argument("--teacher", required=True, metavar="URL|DIR",
                   help="an OpenAI-compatible endpoint http(s)://HOST:PORT/v1, or a model directory (HF or run)")
    p.add_argument("--teacher-model", metavar="ID", help="the served model (default: the only one listed)")
    p.add_argument("--tokenizer", metavar="DIR", help="the teacher's tokenizer and chat template (required with an "
                   "endpoint; default for a directory: its own)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="completions: glmtune renders the prompt (default); chat: the engine's template")
    p.add_argument("--top-logprobs", type=int, metavar="K", help="keep the top-K log-probs per answer token "
                   "(engines cap K, vLLM at 20 by default)")
    p.add_argument("--samples", type=int, default=1, metavar="N", help="answers per prompt until one is kept")
    p.add_argument("--keep-if", metavar="SUITE", help="keep only answers passing the suite's format scorers")
    p.add_argument("--max-new-tokens", type=int, default=512, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-thinking", action="store_true", help="render prompts with reasoning on")
    p.add_argument("--keep-truncated", action="store_true",
                   help="keep answers cut at --max-new-tokens (default: rejected, as incomplete)")
    p.add_argument("--logprob-dtype", choices=("float32", "float16"), default="float32",
                   help="how the sidecar stores log-probs (default float32)")
    e = p.add_argument_group("endpoint teacher")
    e.add_argument("--concurrency", type=int, metavar="N", help="requests in flight (default 8)")
    e.add_argument("--timeout", type=float, metavar="S", help="seconds per attempt (default 120)")
    e.add_argument("--retries", type=int, metavar="N", help="retries after a 408/429/5xx/timeout (default 3)")
    e.add_argument("--rate-limit", type=float, metavar="R", help="at most R requests a second")
    e.add_argument("--max-response-bytes", type=int, metavar="B", help="cap on a response (default 16 MiB)")
    e.add_argument("--api-key-env", metavar="VAR", help="the environment variable holding the API key (default "
                   "GLMTUNE_ENDPOINT_API_KEY); the key is never written")
    e.add_argument("--no-token-ids", action="store_true",
                   help="do not ask for return_tokens_as_token_ids (map token strings through the tokenizer)")
    local = p.add_argument_group("in-process teacher")
    local.add_argument("--batch-size", type=int, metavar="N", help="prompts decoded together (default 8)")
    local.add_argument("--device", metavar="DEV", help="torch device (default cpu)")
    p.set_defaults(func=_generate)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("distill", help="distil a teacher into a student: generate its answers",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="distill_command", metavar="ACTION")
    parser.set_defaults(func=lambda _: parser.print_help() or 0)
    _add_generate(actions)
