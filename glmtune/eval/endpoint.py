"""A model behind an OpenAI-compatible server (vLLM, SGLang, `transformers serve`) as an eval backend.

`--base` / `--candidate` given as http(s)://HOST:PORT/v1 names such a server; `--base-model` /
`--candidate-model` the served model (default: the only one GET /v1/models lists). Its options,
the served model and the fingerprint (what the server says of itself) are `endpoint_source`'s.

Two request modes (`--api`):
  * completions: glmtune renders the prompt with the suite's chat template and the tokenizer's
    special tokens (the same text the in-process model tokenizes: Llama-3's begins with its
    <|begin_of_text|>) and sends it as text to /v1/completions; the engine stops on the
    model's own end-of-turn ids (config.json's `eos_token_id`, which a glmtune export lists:
    <|endoftext|>, <|user|>, <|observation|>), an answer that holds the template's stop tokens (an
    engine that keeps special tokens; `Prompting.stop_tokens`: GLM's, ChatML's <|im_end|>, ...) is
    cut at them, the suite's stop strings are cut client-side as in-process generation cuts them,
    and the tool calls are parsed from the text in the template's format by `answering`
    (Turn.calls None). Base and candidate are compared under one wrapper.
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

Requests run `--concurrency` at a time, each with `--timeout` and `--retries` (endpoint_client),
through one guarded HTTP path (endpoint_http: every body capped at `--max-response-bytes`, every
request ended by its deadline, no redirect off the endpoint's origin); each answer is read as the
API defines it (endpoint_responses: types, ranges, lengths). A request that still fails, or whose
answer is malformed, is that request's failure, counted by kind in the operations and named by
server and request id. Generated tokens are counted with the suite's tokenizer on the returned
text (at most max_new_tokens), never taken from the server's `usage`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from glmtune.data.chat_template import IGNORE_INDEX, render_conversation
from glmtune.data.packing import next_token_targets
from glmtune.eval.backends import Failed, NotAvailable, Turn
from glmtune.eval.endpoint_client import FaultLog, MalformedResponse, RequestFailed, ServerFailed, call
from glmtune.eval.endpoint_responses import answer_chars, check_answer_length, prompt_logprobs, read
from glmtune.eval.endpoint_source import (NOT_AVAILABLE, EndpointOptions, EndpointSource, client_for, is_endpoint,
                                          resolve_endpoint)
from glmtune.eval.operations import summarize
from glmtune.eval.scorers.preference import PairLogps, pair_samples
from glmtune.eval.scorers.reference_loss import reference_sample
from glmtune.eval.tool_calls import ARGUMENTS, ParsedCall
from glmtune.io.text_limits import clipped, parse_json

__all__ = ["Endpoint", "EndpointOptions", "EndpointSource", "is_endpoint", "resolve_endpoint"]  # evaluate's

def _cut_at_stop(text: str, stop_strings: list[str]) -> tuple[str, bool]:
    """The text before the first stop string (in-process generation's cut), and whether one was found."""
    hits = [i for i in (text.find(s) for s in stop_strings if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Contract/answering messages in the chat API's form: call ids, JSON-string arguments, tool_call_id
    (eval's endpoint arm and distill generate's endpoint teacher)."""
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


def _engine_calls(tool_calls: list[dict[str, Any]] | None) -> list[ParsedCall]:
    """The chat API's `tool_calls` (as `endpoint_responses` checked them) as the turn's calls."""
    parsed = []
    for c in tool_calls or []:
        name = c["function"]["name"]
        try:
            arguments = parse_json(c["function"].get("arguments") or "{}", "arguments", **ARGUMENTS)
        except ValueError as exc:  # as the completions parser refuses a value: not JSON, NaN, a key twice
            parsed.append(ParsedCall(name, None, f"arguments are not JSON ({clipped(exc, 200)})"))
            continue
        if isinstance(arguments, dict):
            parsed.append(ParsedCall(name, arguments))
        else:
            parsed.append(ParsedCall(name, None, "arguments are not a JSON object"))
    return parsed


class Endpoint:
    """The `backends.Backend` of a served model (module docstring)."""

    def __init__(self, source: EndpointSource, options: EndpointOptions) -> None:
        self.source = source
        self.policy = options.policy()
        self.concurrency = options.concurrency if options.concurrency is not None else 8
        self.max_response_bytes = options.response_bytes()
        self.client, _, self.transport = client_for(source.source, self.policy, self.max_response_bytes,
                                                    source.api_key_env)
        self.faults = FaultLog()
        self._answer_chars: int | None = None  # the most characters an answer may hold (endpoint_responses)
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
        if self._answer_chars is None:  # the tokenizer's longest token, in characters (of its byte-level form)
            longest = max(len(token) for token in prompting.tokenizer.get_vocab())
            self._answer_chars = answer_chars(prompting.decoding.max_new_tokens, longest, self.source.api)
        began = time.perf_counter()
        futures = [self._pool.submit(self._answer_one, messages, tools, prompting, seed)
                   for messages, tools in requests]
        results = [future.result() for future in futures]
        return results, time.perf_counter() - began

    def _answer_one(self, messages, tools, prompting, seed) -> Turn | Failed:
        if self.source.api == "completions":
            try:
                # the in-process path's text: the tokenizer's special tokens too (Llama-3's bos_token)
                text = render_conversation(messages, tools=tools, template=prompting.template,
                                           enable_thinking=prompting.enable_thinking, add_generation_prompt=True,
                                           tokenizer=prompting.tokenizer)
                num_prompt_tokens = len(prompting.tokenizer(text, add_special_tokens=False)["input_ids"])
            except Exception as exc:  # e.g. a tool result the template cannot render
                return Failed("rendering the prompt", exc)
            request = lambda: self._complete(text, num_prompt_tokens, prompting, seed)  # noqa: E731
        else:
            request = lambda: self._chat(messages, tools, prompting, seed)  # noqa: E731
        began = time.perf_counter()
        try:
            turn = call(request, self.faults, self.policy, self.source.source)
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
        max_new_tokens = prompting.decoding.max_new_tokens
        raw = self.client.completions.with_raw_response.create(prompt=text, **self._sampling(prompting, seed))
        response = read(raw.http_response.content, "completion", "POST /v1/completions", max_new_tokens)
        choice = response["choices"][0]
        check_answer_length(len(choice["text"]), self._answer_chars, max_new_tokens, "POST /v1/completions")
        prompt_tokens = (response.get("usage") or {}).get("prompt_tokens")
        if prompt_tokens is not None and prompt_tokens != num_prompt_tokens:
            self._note("prompt_token_mismatches")
        generated, _ = _cut_at_stop(choice["text"], list(prompting.stop_tokens))  # an engine that keeps special tokens
        text, cut = _cut_at_stop(generated, prompting.decoding.stop_strings)
        return Turn(text, self._finish(choice.get("finish_reason"), cut), self._tokens(generated, prompting), 0.0)

    def _chat(self, messages, tools, prompting, seed: int) -> Turn:
        args = self._sampling(prompting, seed)
        args["extra_body"] = {**args.get("extra_body", {}),
                              "chat_template_kwargs": {"enable_thinking": prompting.enable_thinking}}
        if prompting.decoding.stop_strings:
            args["stop"] = prompting.decoding.stop_strings
        if tools:
            args["tools"] = [t if "function" in t else {"type": "function", "function": t} for t in tools]
        max_new_tokens = prompting.decoding.max_new_tokens
        raw = self.client.chat.completions.with_raw_response.create(messages=chat_messages(messages), **args)
        choice = read(raw.http_response.content, "chat", "POST /v1/chat/completions", max_new_tokens)["choices"][0]
        content = choice["message"].get("content") or ""
        tool_calls = choice["message"].get("tool_calls") or []
        spelled = content + "".join(c["function"]["name"] + (c["function"].get("arguments") or "") for c in tool_calls)
        check_answer_length(len(spelled), self._answer_chars, max_new_tokens, "POST /v1/chat/completions")
        text, cut = _cut_at_stop(content, prompting.decoding.stop_strings)
        calls = _engine_calls(tool_calls)
        if not calls and "<tool_call>" in text:
            self._note("unparsed_tool_markup")
        return Turn(text, self._finish(choice.get("finish_reason"), cut), self._tokens(spelled, prompting), 0.0,
                    calls=calls)

    def _note(self, what: str) -> None:
        with self._notes_lock:
            self.notes[what] += 1

    @staticmethod
    def _finish(reason: str | None, cut: bool) -> str:
        return "stop_string" if cut else "length" if reason == "length" else "stop_token"

    @staticmethod
    def _tokens(text: str, prompting) -> int:
        """The answer's tokens, counted here (a server's `usage` could claim any number): the suite's
        tokenizer on the generated text, at most max_new_tokens (the engine's own split may differ)."""
        count = len(prompting.tokenizer(text, add_special_tokens=False)["input_ids"])
        return min(count, prompting.decoding.max_new_tokens)

    # -- teacher-forced metrics: the prompt's log-probabilities --

    def _prompt_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[j] | ids[:j]) for j >= 1 (ids[0] has none); NotAvailable when the engine gives none."""
        if self._no_logprobs is not None:
            raise NotAvailable(self._no_logprobs)
        probing = not self._logprobs_seen
        what = "POST /v1/completions (echo)"

        def request() -> list[float] | None:
            raw = self.client.completions.with_raw_response.create(
                model=self.source.model, prompt=ids, max_tokens=1, temperature=0.0, echo=True, logprobs=0)
            values = prompt_logprobs(read(raw.http_response.content, "echo", what), len(ids), what)
            if values is None and not probing:
                raise MalformedResponse(f"{what}: no prompt log-probabilities, which this engine gave before")
            return values

        # The first request probes: a refusal, or an answer without them, says "not available", and is
        # not counted; any other failure of it is (into the model's log once known).
        log = FaultLog() if probing else self.faults
        try:
            values = call(request, log, self.policy, self.source.source)
        except RequestFailed as exc:
            if probing and exc.kind.startswith("http 4"):
                self._no_logprobs = f"{NOT_AVAILABLE}: /v1/completions with token ids and echo refused ({exc.kind})"
                raise NotAvailable(self._no_logprobs) from None
            if probing:
                self.faults.merge(log)
            raise
        if values is None:
            self._no_logprobs = f"{NOT_AVAILABLE}: /v1/completions with echo returns no prompt log-probabilities"
            raise NotAvailable(self._no_logprobs)
        if probing:
            self.faults.merge(log)
        self._logprobs_seen = True
        return values

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
        """The loss over every window, or none: a window whose request fails leaves the metric null
        (NotAvailable with the reason), since a loss over the others would let the server choose
        which windows count. Every window failing is raised (the engine is broken, not a window)."""
        total, count, failed = 0.0, 0, []
        for ids in windows:
            try:
                logprobs = self._prompt_logprobs(ids)
            except RequestFailed as exc:  # counted in the operations by `call`
                failed.append(exc)
                continue
            total -= sum(logprobs)
            count += len(logprobs)
        if failed and len(failed) == len(windows):
            raise failed[0]
        if failed:
            raise NotAvailable(f"general-text loss not computed: {len(failed)} of {len(windows)} windows failed "
                               f"(first: {failed[0]})")
        return total / count, count

    def failed_every(self, what: str, exc: RequestFailed) -> ServerFailed:
        """What to raise when every request of `what` (a set, the general text) failed: `exc`, one of
        them, with the server's fault counts so far."""
        counts = self.faults.summary()
        kinds = ", ".join(f"{kind} x{n}" for kind, n in counts["failures"].items())
        return ServerFailed(f"the server {clipped(self.source.source, 100)} ({self.source.label}) failed every request "
                            f"of {what}: {counts['failed_requests']} requests failed so far ({kinds}; "
                            f"{counts['http_requests']} attempts, {counts['retries']} retries); one: {exc}")

    def operations(self, latencies: list[float], generated_tokens: int, generate_s: float) -> dict[str, Any]:
        """The scorecard's operations entry: latency and tokens/s at the client, the faults, no memory."""
        ops = summarize(latencies, generated_tokens, generate_s, None, self.source.source)
        ops["peak_memory_note"] = "not measured: the model runs in the engine's process"
        ops["endpoint"] = {"api": self.source.api, "model": self.source.model, "concurrency": self.concurrency,
                           "timeout_s": self.policy.timeout_s, "max_retries": self.policy.retries,
                           "max_response_bytes": self.max_response_bytes, "answered_by": sorted(self.transport.peers),
                           **self.faults.summary(), "prompt_token_mismatches": self.notes["prompt_token_mismatches"],
                           "unparsed_tool_markup": self.notes["unparsed_tool_markup"],
                           "prompt_logprobs": self._no_logprobs or ("available" if self._logprobs_seen else
                                                                                 "not requested")}
        return ops
