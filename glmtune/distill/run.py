"""`glmtune distill generate`'s setup and its run: every option checked, the teacher found, the
output opened (new or resumed), the pending prompts answered (`generate`), the manifest written.

Every option is checked before a request is sent or a file written; a setting that cannot apply
(--samples > 1 with greedy decoding, --rate-limit or --concurrency with an in-process teacher,
--batch-size or --device with an endpoint) is refused rather than ignored.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from glmtune.data.chat_template import load_chat_template
from glmtune.data.sources import file_sha256, inputs_sha256
from glmtune.data.tokenizer import load_tokenizer
from glmtune.distill.generate import Counts, Policy, run_endpoint, run_local, summary
from glmtune.distill.output import Output
from glmtune.distill.prompts import read_prompts
from glmtune.distill.teachers import EndpointTeacher, LocalTeacher
from glmtune.distill.topk_store import LOGPROB_DTYPES, MAX_K
from glmtune.distill.verify import Verifier
from glmtune.eval.endpoint_source import APIS, EndpointOptions, is_endpoint, resolve_endpoint
from glmtune.eval.models import load_model, resolve_model
from glmtune.eval.suite import DecodingConfig
from glmtune.io.json_file import read_json_file
from glmtune.io.outputs import check_output

MAX_SAMPLES = 64
MAX_NEW_TOKENS = 1 << 20


@dataclass
class GenerateOptions:
    data: list[Path]
    out: Path
    teacher: str  # http(s)://HOST:PORT/v1, or a model directory (HF checkpoint or run)
    teacher_model: str | None = None  # the served model id
    tokenizer: Path | None = None
    api: str = "completions"
    top_logprobs: int | None = None
    samples: int = 1
    keep_if: Path | None = None
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    endpoint: EndpointOptions = field(default_factory=EndpointOptions)
    rate_limit: float | None = None  # requests a second
    token_ids: bool = True  # ask the engine for "token_id:N" tokens
    logprob_dtype: str = "float32"
    batch_size: int | None = None  # in-process prompts decoded together (default 8)
    device: str | None = None  # in-process (default cpu)
    enable_thinking: bool = False
    keep_truncated: bool = False  # keep answers cut at max_new_tokens (default: rejected)


def check_options(o: GenerateOptions) -> None:
    """ValueError (one line, naming the option) for a value out of range or a setting that cannot apply."""
    d = o.decoding
    if o.top_logprobs is not None and not 1 <= o.top_logprobs <= MAX_K:
        raise ValueError(f"--top-logprobs {o.top_logprobs}: expected an integer from 1 to {MAX_K}")
    if not 1 <= o.samples <= MAX_SAMPLES:
        raise ValueError(f"--samples {o.samples}: expected an integer from 1 to {MAX_SAMPLES}")
    if o.samples > 1 and d.temperature == 0:
        raise ValueError(f"--samples {o.samples} with --temperature 0: greedy decoding gives the same answer each "
                         "time; sample with --temperature > 0")
    if not 1 <= d.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {d.max_new_tokens}: expected an integer from 1 to {MAX_NEW_TOKENS}")
    if not (math.isfinite(d.temperature) and 0 <= d.temperature <= 100) or not 0 < d.top_p <= 1 or d.top_k < 0:
        raise ValueError(f"--temperature {d.temperature}, --top-p {d.top_p}, --top-k {d.top_k}: expected a "
                         "temperature from 0 to 100, top-p in (0, 1] and top-k >= 0")
    if o.logprob_dtype not in LOGPROB_DTYPES:
        raise ValueError(f"--logprob-dtype {o.logprob_dtype}: expected one of {', '.join(LOGPROB_DTYPES)}")
    if o.api not in APIS:
        raise ValueError(f"--api {o.api}: expected one of {', '.join(APIS)}")
    if o.rate_limit is not None and not (math.isfinite(o.rate_limit) and 0 < o.rate_limit <= 1e6):
        raise ValueError(f"--rate-limit {o.rate_limit}: expected requests a second above 0")
    if is_endpoint(o.teacher):
        given = [n for n, v in (("--batch-size", o.batch_size), ("--device", o.device)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} applies to an in-process teacher; --teacher {o.teacher} is an endpoint")
        if o.tokenizer is None:
            raise ValueError("--tokenizer DIR is needed with an endpoint teacher: its chat template renders the "
                             "prompts and its vocabulary maps the engine's tokens to ids")
        key_env = o.endpoint.api_key_env
        if key_env is not None and not os.environ.get(key_env):
            raise ValueError(f"--api-key-env {key_env}: the environment variable is not set (or empty)")
        o.endpoint.check(None, o.teacher)
    else:
        e = o.endpoint
        given = [n for n, v in (("--teacher-model", o.teacher_model), ("--rate-limit", o.rate_limit),
                                ("--concurrency", e.concurrency), ("--timeout", e.timeout_s), ("--retries", e.retries),
                                ("--max-response-bytes", e.max_response_bytes), ("--api-key-env", e.api_key_env),
                                ("--api", None if o.api == "completions" else o.api)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} applies to an endpoint teacher; --teacher {o.teacher} is a directory")
        if o.batch_size is not None and not 1 <= o.batch_size <= 1024:
            raise ValueError(f"--batch-size {o.batch_size}: expected an integer from 1 to 1024")


def settings(o: GenerateOptions, teacher: dict[str, Any], tokenizer_dir: Path, verifier: Verifier | None) -> dict:
    """What a resumed run must share with the first (output.Output compares them)."""
    return {"data_sha256": inputs_sha256(o.data), "teacher": teacher, "api": o.api,
            "tokenizer": str(tokenizer_dir.resolve()), "tokenizer_sha256": file_sha256(tokenizer_dir),
            "decoding": {k: v for k, v in asdict(o.decoding).items() if k in ("max_new_tokens", "temperature", "top_k",
                                                                               "top_p", "seed")},
            "enable_thinking": o.enable_thinking, "top_logprobs": o.top_logprobs, "samples": o.samples,
            "keep_truncated": o.keep_truncated,
            "keep_if": {"suite": str(verifier.suite_path), "sha256": verifier.sha256} if verifier else None,
            "token_ids": o.token_ids if o.top_logprobs else None, "logprob_dtype": o.logprob_dtype}


def _endpoint_teacher(o: GenerateOptions, tokenizer, template: str, log: Callable[[str], None]):
    o.endpoint.candidate_model = o.teacher_model  # resolve_endpoint reads the model of its role from there
    o.endpoint.api = o.api
    source = resolve_endpoint(o.teacher, "teacher", o.endpoint)
    teacher = EndpointTeacher(source, o.endpoint, tokenizer, template, o.decoding, o.top_logprobs, o.token_ids,
                              o.rate_limit, o.enable_thinking, log)
    return teacher, source.fingerprint(), len(tokenizer), {"endpoint": source.source, "model": source.model}


def _local_source(o: GenerateOptions):
    try:
        return resolve_model(o.teacher, "candidate")
    except ValueError as exc:
        raise ValueError(str(exc).replace("--candidate", "--teacher")) from None


def _local_teacher(o: GenerateOptions, source, tokenizer, template: str):
    net = load_model(source, torch.device(o.device or "cpu"), None)
    config = read_json_file(source.weights_dir / "config.json", "teacher config")
    vocab = config.get("vocab_size")  # the head's width: the ids a top-K can hold
    vocab = max(vocab, len(tokenizer)) if type(vocab) is int and vocab > 0 else len(tokenizer)
    identity = {"path": str(source.source), "kind": source.kind, "weights_dir": str(source.weights_dir),
                "config_sha256": file_sha256(source.weights_dir / "config.json"),
                "adapter": str(source.adapter_dir) if source.adapter_dir else None}
    teacher = LocalTeacher(net, tokenizer, template, o.decoding, o.top_logprobs, o.enable_thinking)
    return teacher, identity, vocab, identity


def run_generate(o: GenerateOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Answer the pending prompts into `o.out` (module docstring); the manifest's counts."""
    check_options(o)
    prompts = read_prompts(o.data)
    verifier = Verifier(o.keep_if) if o.keep_if is not None else None
    local = None if is_endpoint(o.teacher) else _local_source(o)
    tokenizer_dir = o.tokenizer if o.tokenizer is not None else local.tokenizer_dir
    if not (o.out / "manifest.json").exists():
        reads = [("DATA", p) for p in o.data] + [("--tokenizer", tokenizer_dir)]
        reads += local.reads() if local is not None else []
        check_output(o.out, sources=reads, what="--out", command="distill generate")
    tokenizer, template = load_tokenizer(tokenizer_dir), load_chat_template(tokenizer_dir)
    if local is None:
        teacher, identity, vocab, stable = _endpoint_teacher(o, tokenizer, template, log)
    else:
        teacher, identity, vocab, stable = _local_teacher(o, local, tokenizer, template)
    output = Output(o.out, settings(o, stable, tokenizer_dir, verifier), o.top_logprobs, vocab, o.logprob_dtype)
    if verifier is not None and verifier.unapplied:
        log(f"--keep-if: the suite's {', '.join(verifier.unapplied)} scorers compare with eval rows' reference "
            "calls, which prompts do not have: not applied (its format scorers are)")
    pending = [p for p in prompts if p.row_id not in output.done and p.row_id not in output.rejected]
    log(f"{len(prompts)} prompts: {len(prompts) - len(pending)} already done, {len(pending)} to answer"
        + (f" (resuming {o.out})" if output.resumed else ""))
    counts, began = Counts(), time.monotonic()
    output.write_manifest(status="running", teacher=identity, rows="rows.jsonl",
                          topk="topk" if o.top_logprobs else None)
    status = "interrupted"
    try:
        policy = Policy(o.samples, o.decoding.seed, verifier, o.keep_truncated)
        if local is None:
            run_endpoint(teacher, pending, output, counts, policy, o.endpoint.concurrency or 8, log)
        else:
            run_local(teacher, pending, output, counts, policy, o.batch_size or 8, log)
        status = "complete" if not counts.failures else "incomplete"
    finally:
        faults = teacher.faults.summary() if local is None else None
        result = summary(output, counts, len(prompts), began, faults)
        if local is None and teacher.notes:
            result["engine_notes"] = list(teacher.notes)
        output.write_manifest(status=status, counts=result)
        output.close()
        if local is None:
            teacher.close()
    return result
