"""A model behind an OpenAI-compatible server (vLLM, SGLang, `transformers serve`) as an eval backend.

`--base` / `--candidate` given as http(s)://HOST:PORT/v1 names such a server; `--base-model` /
`--candidate-model` the served model (default: the only one GET /v1/models lists). The model's
fingerprint is what the server says of itself: the URL, the served model id, `owned_by`, the
`server` header and the version GET /version gives (vLLM) — no weights hash: the weights are
the engine's.

Two request modes (`--api`):
  * completions: glmtune renders the prompt with the suite's chat template (the same text the
    in-process model tokenizes) and sends it as text to /v1/completions; the engine stops on the
    model's own end-of-turn ids (config.json's `eos_token_id`, which a glmtune export lists:
    <|endoftext|>, <|user|>, <|observation|>), the suite's stop strings are cut client-side as
    in-process generation cuts them, and the GLM-5 tool calls are parsed from the text by
    `answering` (Turn.calls None). Base and candidate are compared under one wrapper.
  * chat: the messages and tools go to /v1/chat/completions as they are (the engine's chat
    template and tool-call parser: what production traffic sees); the returned `tool_calls`
    become the turn's calls (an argument string that is not a JSON object: a call with an error).

Teacher-forced metrics (reference loss, general-text loss, the preference scorer's pair
log-probabilities) need the prompt's log-probabilities: /v1/completions with token ids, `echo`
and `logprobs` (vLLM). An engine that refuses or ignores
that (`transformers serve` ignores echo and logprobs and takes text prompts only) raises
`NotAvailable`, and the scorecard says "not available from this engine" for those metrics.
The serving metrics (MTP acceptance, indexer recall: `serving.py`) read the model's own layers,
which no engine exposes: not available from any endpoint.

Requests run `--concurrency` at a time, each with `--timeout` and `--retries` (endpoint_client);
a request that still fails is that request's failure, counted by kind in the operations.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.data.chat_template import IGNORE_INDEX, render_conversation
from glmtune.data.packing import next_token_targets
from glmtune.data.tokenizer import CHAT_STOP_TOKENS
from glmtune.eval.backends import Failed, NotAvailable, Turn
from glmtune.eval.endpoint_client import FaultLog, MalformedResponse, RequestFailed, RetryPolicy, call
from glmtune.eval.operations import summarize
from glmtune.eval.scorers.preference import PairLogps, pair_samples
from glmtune.eval.scorers.reference_loss import reference_sample
from glmtune.eval.tool_calls import ParsedCall

APIS = ("completions", "chat")
NOT_AVAILABLE = "not available from this engine"
_URL = re.compile(r"^https?://[^/\s]+/v1/?$")
_API_KEY_ENV = "GLMTUNE_ENDPOINT_API_KEY"  # sent as the bearer token; most local servers ignore it


def is_endpoint(arg: str | os.PathLike[str]) -> bool:
    """Whether a model argument names a server (http:// or https://) rather than a directory."""
    return isinstance(arg, str) and arg.lower().startswith(("http://", "https://"))


@dataclass
class EndpointOptions:
    """The `glmtune eval` options of endpoint models (None: not given on the command line)."""

    api: str | None = None  # "completions" (default) | "chat"
    concurrency: int | None = None  # requests in flight (default 8)
    timeout_s: float | None = None  # per attempt (default 120)
    retries: int | None = None  # attempts after the first (default 3)
    base_model: str | None = None
    candidate_model: str | None = None
    tokenizer: Path | None = None  # the suite's tokenizer + template when no model is local

    def check(self, base_arg, candidate_arg) -> None:
        """ValueError (one line, naming the option) for a value out of range, or an endpoint option given
        with no endpoint model to apply to (an accepted setting must take effect)."""
        if self.api is not None and self.api not in APIS:
            raise ValueError(f"--api {self.api}: expected one of {', '.join(APIS)}")
        for option, value, low in (("--concurrency", self.concurrency, 1), ("--retries", self.retries, 0)):
            if value is not None and not low <= value <= 1024:
                raise ValueError(f"{option} {value}: expected an integer from {low} to 1024")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 86400):
            raise ValueError(f"--timeout {self.timeout_s}: expected seconds above 0 (at most 86400)")
        for option, value, arg in (("--base-model", self.base_model, base_arg),
                                   ("--candidate-model", self.candidate_model, candidate_arg)):
            if value is not None and not is_endpoint(arg):
                raise ValueError(f"{option} names a served model, but --{option[2:-6]} {arg} is not an endpoint "
                                 "(http(s)://HOST:PORT/v1)")
        if not (is_endpoint(base_arg) or is_endpoint(candidate_arg)):
            given = [o for o, v in (("--api", self.api), ("--concurrency", self.concurrency),
                                    ("--timeout", self.timeout_s), ("--retries", self.retries),
                                    ("--tokenizer", self.tokenizer)) if v is not None]
            if given:
                raise ValueError(f"{given[0]} applies to an endpoint model (--base or --candidate "
                                 "http(s)://HOST:PORT/v1); neither is one")

    def policy(self) -> RetryPolicy:
        return RetryPolicy(self.timeout_s if self.timeout_s is not None else 120.0,
                           self.retries if self.retries is not None else 3)


@dataclass
class EndpointSource:
    """A served model in the place of `models.ModelSource` (what evaluate.py reads of one)."""

    label: str
    role: str
    source: str  # the endpoint URL, ending in /v1
    model: str  # the served model id
    engine: dict[str, str | None]  # {"owned_by", "server", "version"} as the server gives them
    api: str
    kind: str = "endpoint"
    merged: bool | None = None
    adapter_dir: None = None

    def reads(self) -> list:
        return []  # nothing on disk is read: no output-safety check applies

    def fingerprint(self) -> dict[str, str | None]:
        return {"endpoint": self.source, "model": self.model, "api": self.api,
                "engine_server": self.engine.get("server"), "engine_owned_by": self.engine.get("owned_by"),
                "engine_version": self.engine.get("version")}


def _client(url: str, timeout_s: float):
    try:
        import openai  # torch-free; an optional dependency: only endpoint evaluations need it
    except ImportError:
        raise ValueError("an endpoint model needs the openai package (pip install 'glmtune[endpoint]')") from None
    return openai.OpenAI(base_url=url, api_key=os.environ.get(_API_KEY_ENV, "EMPTY"), timeout=timeout_s,
                         max_retries=0)


def _engine_version(url: str, timeout_s: float) -> str | None:
    """GET <root>/version's "version" (vLLM answers it; others 404): None when not given."""
    try:
        with urllib.request.urlopen(url[:-len("/v1")] + "/version", timeout=min(timeout_s, 10.0)) as response:
            version = json.loads(response.read(4096)).get("version")
    except Exception:  # not offered, not JSON: the engine does not say
        return None
    return str(version) if isinstance(version, (str, int, float)) else None


def resolve_endpoint(arg: str, role: str, options: EndpointOptions) -> EndpointSource:
    """The served model `--<role>` ARG names (its /v1/models listing and the chosen id); ValueError
    (one line) when the server does not answer or the model is ambiguous or unknown."""
    url = arg.rstrip("/")
    if not _URL.match(url):
        raise ValueError(f"--{role} {arg}: an endpoint is http(s)://HOST:PORT/v1")
    policy = options.policy()
    client = _client(url, policy.timeout_s)

    def listing():
        raw = client.models.with_raw_response.list()
        return raw.headers, raw.parse().data  # parsed inside the request: a malformed reply is a fault

    try:
        headers, models = call(listing, FaultLog(), policy)
    except RequestFailed as exc:
        raise ValueError(f"--{role} {url}: GET /v1/models failed ({exc})") from None
    finally:
        client.close()
    served = {m.id: getattr(m, "owned_by", None) for m in models}
    wanted = options.base_model if role == "base" else options.candidate_model
    if wanted is None:
        if len(served) != 1:
            raise ValueError(f"--{role} {url} serves {len(served)} models ({', '.join(served) or 'none'}); "
                             f"name one with --{role}-model")
        wanted = next(iter(served))
    elif served and wanted not in served:
        raise ValueError(f"--{role}-model {wanted}: {url} serves {', '.join(served)}")
    engine = {"owned_by": served.get(wanted), "server": headers.get("server"),
              "version": _engine_version(url, policy.timeout_s)}
    return EndpointSource(role, role, url, wanted, engine, options.api or "completions")


def _cut_at_stop(text: str, stop_strings: list[str]) -> tuple[str, bool]:
    """The text before the first stop string (in-process generation's cut), and whether one was found."""
    hits = [i for i in (text.find(s) for s in stop_strings if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """answering's messages in the chat API's form: call ids, JSON-string arguments, tool_call_id."""
    out, pending = [], []
    for n, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = [{"id": f"call_{n}_{i}", "type": "function",
                      "function": {"name": c["function"]["name"],
                                   "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)}}
                     for i, c in enumerate(message["tool_calls"])]
            message["tool_calls"], pending = calls, [c["id"] for c in calls]
        elif message.get("role") == "tool" and pending:
            message["tool_call_id"] = pending.pop(0)
        out.append(message)
    return out


def _engine_calls(tool_calls) -> list[ParsedCall]:
    parsed = []
    for c in tool_calls or []:
        try:
            arguments = json.loads(c.function.arguments or "{}")
        except json.JSONDecodeError as exc:
            parsed.append(ParsedCall(c.function.name, None, f"arguments are not JSON ({exc})"))
            continue
        if isinstance(arguments, dict):
            parsed.append(ParsedCall(c.function.name, arguments))
        else:
            parsed.append(ParsedCall(c.function.name, None, "arguments are not a JSON object"))
    return parsed


class Endpoint:
    """The `backends.Backend` of a served model (module docstring)."""

    def __init__(self, source: EndpointSource, options: EndpointOptions) -> None:
        self.source = source
        self.policy = options.policy()
        self.concurrency = options.concurrency if options.concurrency is not None else 8
        self.client = _client(source.source, self.policy.timeout_s)
        self.faults = FaultLog()
        # completions: responses whose engine counted other prompt tokens than glmtune's tokenizer (a BOS);
        # chat: content holding <tool_call> markup the engine did not parse. Counted from the request threads.
        self.notes: Counter[str] = Counter()
        self._notes_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="glmtune-endpoint")
        self._no_logprobs: str | None = None  # why prompt log-probabilities are not available, once known
        self._logprobs_seen = False  # a request has returned them

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.client.close()

    def batch_size(self, decoding) -> int:
        # Greedy answers do not depend on the batch: hand over enough requests to keep `concurrency` in flight.
        return max(decoding.batch_size, self.concurrency)

    def answer(self, requests, prompting, seed):
        began = time.perf_counter()
        futures = [self._pool.submit(self._answer_one, messages, tools, prompting, seed)
                   for messages, tools in requests]
        results = [future.result() for future in futures]
        return results, time.perf_counter() - began

    def _answer_one(self, messages, tools, prompting, seed) -> Turn | Failed:
        if self.source.api == "completions":
            try:
                text = render_conversation(messages, tools=tools, template=prompting.template,
                                           enable_thinking=prompting.enable_thinking, add_generation_prompt=True)
                num_prompt_tokens = len(prompting.tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception as exc:  # e.g. a tool result the template cannot render
                return Failed("rendering the prompt", exc)
            request = lambda: self._complete(text, num_prompt_tokens, prompting, seed)  # noqa: E731
        else:
            request = lambda: self._chat(messages, tools, prompting, seed)  # noqa: E731
        began = time.perf_counter()
        try:
            turn = call(request, self.faults, self.policy)
        except RequestFailed as exc:
            return Failed("generation", exc)
        turn.latency_s = time.perf_counter() - began  # at the client, retries included
        return turn

    def _sampling(self, prompting, seed: int) -> dict[str, Any]:
        d = prompting.decoding
        args: dict[str, Any] = {"model": self.source.model, "max_tokens": d.max_new_tokens,
                                "temperature": d.temperature, "top_p": d.top_p, "seed": seed}
        if d.top_k:
            args["extra_body"] = {"top_k": d.top_k}  # vLLM / SGLang; an engine without it refuses the request
        return args

    def _complete(self, text: str, num_prompt_tokens: int, prompting, seed: int) -> Turn:
        response = self.client.completions.create(prompt=text, **self._sampling(prompting, seed))
        if not response.choices or response.choices[0].text is None:
            raise MalformedResponse("a completion without choices[0].text")
        choice = response.choices[0]
        if response.usage is not None and response.usage.prompt_tokens != num_prompt_tokens:
            self._note("prompt_token_mismatches")
        raw, _ = _cut_at_stop(choice.text, list(CHAT_STOP_TOKENS))  # an engine that keeps special tokens
        text, cut = _cut_at_stop(raw, prompting.decoding.stop_strings)
        return Turn(text, self._finish(choice.finish_reason, cut), self._tokens(response, text, prompting), 0.0)

    def _chat(self, messages, tools, prompting, seed: int) -> Turn:
        args = self._sampling(prompting, seed)
        args["extra_body"] = {**args.get("extra_body", {}),
                              "chat_template_kwargs": {"enable_thinking": prompting.enable_thinking}}
        if prompting.decoding.stop_strings:
            args["stop"] = prompting.decoding.stop_strings
        if tools:
            args["tools"] = [t if "function" in t else {"type": "function", "function": t} for t in tools]
        response = self.client.chat.completions.create(messages=_chat_messages(messages), **args)
        if not response.choices or response.choices[0].message is None:
            raise MalformedResponse("a chat completion without choices[0].message")
        choice = response.choices[0]
        text, cut = _cut_at_stop(choice.message.content or "", prompting.decoding.stop_strings)
        calls = _engine_calls(choice.message.tool_calls)
        if not calls and "<tool_call>" in text:
            self._note("unparsed_tool_markup")
        return Turn(text, self._finish(choice.finish_reason, cut), self._tokens(response, text, prompting), 0.0,
                    calls=calls)

    def _note(self, what: str) -> None:
        with self._notes_lock:
            self.notes[what] += 1

    @staticmethod
    def _finish(reason: str | None, cut: bool) -> str:
        return "stop_string" if cut else "length" if reason == "length" else "stop_token"

    @staticmethod
    def _tokens(response, text: str, prompting) -> int:
        if response.usage is not None and response.usage.completion_tokens is not None:
            return int(response.usage.completion_tokens)
        return len(prompting.tokenizer(text, add_special_tokens=False)["input_ids"])  # the engine did not say

    # -- teacher-forced metrics: the prompt's log-probabilities --

    def _prompt_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[j] | ids[:j]) for j >= 1 (ids[0] has none); NotAvailable when the engine gives none."""
        if self._no_logprobs is not None:
            raise NotAvailable(self._no_logprobs)
        request = lambda: self.client.completions.create(  # noqa: E731
            model=self.source.model, prompt=ids, max_tokens=1, temperature=0.0, echo=True, logprobs=0)
        probing = not self._logprobs_seen
        try:  # the first request probes: a refusal then says "not offered", not a failed request
            response = call(request, FaultLog() if probing else self.faults, self.policy)
        except RequestFailed as exc:
            if probing and exc.kind.startswith("http 4"):
                self._no_logprobs = f"{NOT_AVAILABLE}: /v1/completions with token ids and echo refused ({exc.kind})"
                raise NotAvailable(self._no_logprobs) from None
            raise
        logprobs = response.choices[0].logprobs if response.choices else None
        values = getattr(logprobs, "token_logprobs", None) or []
        if len(values) < len(ids):
            self._no_logprobs = f"{NOT_AVAILABLE}: /v1/completions with echo returns no prompt log-probabilities"
            raise NotAvailable(self._no_logprobs)
        self._logprobs_seen = True
        return [float(v) for v in values[1:len(ids)]]

    def reference_loss(self, row, prompting) -> float:
        ids, targets = reference_sample(row, prompting)
        logprobs = self._prompt_logprobs(ids)  # logprobs[i] scores ids[i + 1], the target of position i
        scored = [-logprobs[i] for i, target in enumerate(targets[:-1]) if target != IGNORE_INDEX]
        return sum(scored) / max(len(scored), 1)

    def pair_logps(self, row, prompting) -> PairLogps:
        """The pair's sums over each answer's tokens, from the engine's prompt log-probabilities of
        prompt + answer (the tokens `tokenize_pair` labels, as the local model scores them)."""
        sums, counts = [], []
        for sample in pair_samples(row, prompting):
            logprobs = self._prompt_logprobs(sample.input_ids)  # logprobs[i] scores input_ids[i + 1]
            targets = next_token_targets(sample.labels)
            scored = [logprobs[i] for i, target in enumerate(targets[:-1]) if target != IGNORE_INDEX]
            sums.append(sum(scored))
            counts.append(len(scored))
        return PairLogps(sums[0], sums[1], counts[0], counts[1])

    def serving_sums(self, row, prompting) -> dict[str, tuple[float, float]]:
        raise NotAvailable(f"{NOT_AVAILABLE}: a served model exposes no MTP drafts or indexer selections "
                           "(evaluate the checkpoint in-process for them)")

    def text_loss(self, windows: list[list[int]]) -> tuple[float, int]:
        total, count = 0.0, 0
        for ids in windows:
            logprobs = self._prompt_logprobs(ids)
            total -= sum(logprobs)
            count += len(logprobs)
        return total / count, count

    def operations(self, latencies: list[float], generated_tokens: int, generate_s: float) -> dict[str, Any]:
        """The scorecard's operations entry: latency and tokens/s at the client, the faults, no memory."""
        ops = summarize(latencies, generated_tokens, generate_s, None, self.source.source)
        ops["peak_memory_note"] = "not measured: the model runs in the engine's process"
        ops["endpoint"] = {"api": self.source.api, "model": self.source.model, "concurrency": self.concurrency,
                           "timeout_s": self.policy.timeout_s, "max_retries": self.policy.retries,
                           **self.faults.summary(), "prompt_token_mismatches": self.notes["prompt_token_mismatches"],
                           "unparsed_tool_markup": self.notes["unparsed_tool_markup"],
                           "prompt_logprobs": self._no_logprobs or ("available" if self._logprobs_seen else
                                                                                 "not requested")}
        return ops
