"""The teacher that answers the prompts: a served model (`EndpointTeacher`, any OpenAI-compatible
engine) or a glmtune model in this process (`LocalTeacher`). Both give `Answer`s: the answer's
text, how it finished, and (with --top-logprobs K) its tokens' top-K log-probabilities.

The endpoint goes through eval's client (`glmtune.eval.endpoint_source.client_for`,
`endpoint_client.call`: the guarded HTTP path, retries with backoff, per-request deadlines, the
API key read from the named environment variable) and eval's response reader
(`endpoint_responses.read`: a body that is not the API's JSON, NaN included, fails the request
as "malformed"). Requests are spaced by `--rate-limit` (requests a second, over all threads).

Two request modes, as `glmtune eval --api`: `completions` renders the prompt with the teacher
tokenizer's chat template (the text the student is trained on) and asks for `logprobs: K`;
`chat` sends the messages and tools (the engine's template and tool parser) and asks for
`logprobs: true, top_logprobs: K`. With `token_ids` (default) the request also asks for
`return_tokens_as_token_ids` (vLLM: tokens come back as "token_id:N"; SGLang ignores it); an
engine that refuses it (HTTP 400/422 on the first such requests: transformers serve refuses unknown
fields) gets the request again without it, said in one line, and its token strings are mapped.

The in-process teacher decodes with `glmtune.generation.generate` (greedy or seeded sampling,
the template's stop tokens) and takes the top-K of log_softmax of each step's logits: the raw
distribution, as engines return it (vLLM's default), not the temperature-scaled one it sampled.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from glmtune.data.chat_generation import stop_token_ids, stop_tokens
from glmtune.data.chat_template import chat_format, render_conversation
from glmtune.distill.teacher_logprobs import Malformed, TokenMap, TopK, check_spells, cut_at_stop, from_chat, \
    from_completion
from glmtune.eval.endpoint import chat_messages
from glmtune.eval.endpoint_client import FaultLog, RequestFailed, call
from glmtune.eval.endpoint_responses import read
from glmtune.eval.endpoint_source import EndpointOptions, EndpointSource, client_for
from glmtune.eval.suite import DecodingConfig
from glmtune.eval.tool_call_formats import parser_for
from glmtune.generation import generate


@dataclass
class Answer:
    text: str  # the answer as the engine returned it, cut at the template's stop tokens
    finish: str  # "stop" | "length"
    topk: TopK | None  # None: not asked, or the engine gave none (`no_logprobs`)
    no_logprobs: bool = False  # asked, and the engine returned none
    calls: list[dict[str, Any]] | None = None  # the chat API's parsed tool calls (None: parse the text)


class RateLimit:
    """At most `per_s` request starts a second over all threads (None: no limit)."""

    def __init__(self, per_s: float | None) -> None:
        self.interval = 1.0 / per_s if per_s else 0.0
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval:
            return
        with self._lock:
            start = max(self._next, time.monotonic())
            self._next = start + self.interval
        time.sleep(max(start - time.monotonic(), 0.0))


def _cut(text: str, stops: tuple[str, ...]) -> str:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(hits)] if hits else text


class EndpointTeacher:
    """A served teacher (module docstring); `answer` raises RequestFailed or Malformed."""

    def __init__(self, source: EndpointSource, options: EndpointOptions, tokenizer: Any, template: str,
                 decoding: DecodingConfig, top_logprobs: int | None, token_ids: bool, rate_limit: float | None,
                 enable_thinking: bool = False, log=print) -> None:
        self.source, self.tokenizer, self.template, self.decoding = source, tokenizer, template, decoding
        self.k, self.token_ids, self.enable_thinking = top_logprobs, token_ids, enable_thinking
        self.policy = options.policy()
        self.client, _, self.transport = client_for(source.source, self.policy, options.response_bytes(),
                                                    source.api_key_env)
        self.faults = FaultLog()
        self.limit = RateLimit(rate_limit)
        self.tokens = TokenMap(tokenizer) if top_logprobs else None
        self.stops = stop_tokens(tokenizer, template)
        self.stop_ids = stop_token_ids(tokenizer, template)
        self.log, self.notes = log, []  # what the run learned of the engine, said once each
        self._lock = threading.Lock()
        self._ids_answered = False  # a response to a request asking for token ids has come

    def close(self) -> None:
        self.client.close()

    def _sampling(self, seed: int) -> dict[str, Any]:
        d = self.decoding
        args: dict[str, Any] = {"model": self.source.model, "max_tokens": d.max_new_tokens,
                                "temperature": d.temperature, "top_p": d.top_p, "seed": seed}
        extra: dict[str, Any] = {"top_k": d.top_k} if d.top_k else {}
        if self.k and self.token_ids:
            extra["return_tokens_as_token_ids"] = True
        if extra:
            args["extra_body"] = extra
        return args

    def answer(self, messages: list[dict[str, Any]], tools: list | None, seed: int) -> Answer:
        if self.source.api == "completions":
            prompt = render_conversation(messages, tools=tools, template=self.template, tokenizer=self.tokenizer,
                                         enable_thinking=self.enable_thinking, add_generation_prompt=True)
            request = lambda: self._complete(prompt, seed)  # noqa: E731
        else:
            request = lambda: self._chat(messages, tools, seed)  # noqa: E731
        self.limit.wait()
        text, finish, logprobs, calls = self._call(request)
        parse = from_completion if self.source.api == "completions" else from_chat
        cut = _cut(text, self.stops)
        if not self.k:
            return Answer(cut, finish, None, calls=calls)
        topk = parse(logprobs, self.k, self.tokens)
        if topk is None:
            return Answer(cut, finish, None, no_logprobs=True, calls=calls)
        topk = cut_at_stop(topk, self.stop_ids)
        if calls is None:  # the chat API's tool calls are not in the content's tokens
            check_spells(topk, cut, self.tokenizer, self.stop_ids)
        return Answer(cut, finish, topk, calls=calls)

    def _call(self, request):
        """`call(request)`; while token ids are asked and not yet answered, a 400 or 422 (an engine that
        refuses unknown fields: transformers serve) turns them off, said once, and the request is sent
        again (the refused attempt counted apart, as a probe)."""
        probing = bool(self.k and self.token_ids and not self._ids_answered)
        log = FaultLog() if probing else self.faults
        try:
            result = call(request, log, self.policy, self.source.source)
        except RequestFailed as exc:
            if not (probing and exc.kind in ("http 400", "http 422")):
                if probing:
                    self.faults.merge(log)
                raise
            with self._lock:
                if self.token_ids:
                    self.token_ids = False
                    self.notes.append(f"the engine refused return_tokens_as_token_ids ({exc.kind}): its token "
                                      "strings are mapped through the tokenizer")
                    self.log(self.notes[-1])
            return call(request, self.faults, self.policy, self.source.source)
        if probing:
            self.faults.merge(log)
            self._ids_answered = True
        return result

    def _complete(self, prompt: str, seed: int):
        args = self._sampling(seed)
        if self.k:
            args["logprobs"] = self.k
        raw = self.client.completions.with_raw_response.create(prompt=prompt, **args)
        choice = read(raw.http_response.content, "completion", "POST /v1/completions",
                      self.decoding.max_new_tokens)["choices"][0]
        return choice["text"], _finish(choice.get("finish_reason")), choice.get("logprobs"), None

    def _chat(self, messages, tools, seed: int):
        args = self._sampling(seed)
        args.setdefault("extra_body", {})["chat_template_kwargs"] = {"enable_thinking": self.enable_thinking}
        if self.k:
            args.update(logprobs=True, top_logprobs=self.k)
        if tools:
            args["tools"] = [t if "function" in t else {"type": "function", "function": t} for t in tools]
        raw = self.client.chat.completions.with_raw_response.create(messages=chat_messages(messages), **args)
        choice = read(raw.http_response.content, "chat", "POST /v1/chat/completions",
                      self.decoding.max_new_tokens)["choices"][0]
        calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                                   "arguments": c["function"].get("arguments") or "{}"}}
                 for c in choice["message"].get("tool_calls") or []]
        return (choice["message"].get("content") or "", _finish(choice.get("finish_reason")), choice.get("logprobs"),
                calls or None)


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


class LocalTeacher:
    """A glmtune model in this process (module docstring); `answer_batch` answers prompts together."""

    def __init__(self, net, tokenizer: Any, template: str, decoding: DecodingConfig, top_logprobs: int | None,
                 enable_thinking: bool = False) -> None:
        self.net, self.tokenizer, self.template, self.decoding = net, tokenizer, template, decoding
        self.k, self.enable_thinking = top_logprobs, enable_thinking
        self.stop_ids = stop_token_ids(tokenizer, template)

    def answer_batch(self, prompts: list[tuple[list[dict[str, Any]], list | None]], seed: int) -> list[Answer]:
        ids = [self.tokenizer(render_conversation(m, tools=t, template=self.template, tokenizer=self.tokenizer,
                                                  enable_thinking=self.enable_thinking, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"] for m, t in prompts]
        d = self.decoding
        result = generate(self.net, ids, d.max_new_tokens, tokenizer=self.tokenizer, temperature=d.temperature,
                          top_k=d.top_k, top_p=d.top_p, seed=seed, stop_token_ids=self.stop_ids,
                          return_logits=bool(self.k))
        answers = []
        for row, (tokens, text, reason) in enumerate(zip(result.token_ids, result.texts, result.finish_reasons)):
            topk = self._topk(result.step_logits, row, tokens, reason) if self.k else None
            answers.append(Answer(text, "length" if reason == "length" else "stop", topk))
        return answers

    def _topk(self, step_logits: list[torch.Tensor], row: int, tokens: list[int], reason: str) -> TopK:
        """The row's top-K per generated token, and at the stop token when greedy decoding names it
        (the argmax: a sampled stop token is not recorded by the generator)."""
        tokens = list(tokens)
        if reason == "stop_token" and self.decoding.temperature == 0 and len(step_logits) > len(tokens):
            tokens.append(int(step_logits[len(tokens)][row].argmax()))
        logps_NV = torch.stack([step[row] for step in step_logits[:len(tokens)]]).float().log_softmax(-1) \
            if tokens else torch.zeros(0, max(self.k, 1))
        top = logps_NV.topk(self.k, dim=-1)  # on the model's device; the sidecar is host memory
        return TopK(np.array(tokens, dtype=np.int32), top.indices.int().cpu().numpy().reshape(-1, self.k),
                    top.values.cpu().numpy().reshape(-1, self.k))


def parse_calls(text: str, template: str, tools: list | None) -> tuple[str, list[dict[str, Any]]]:
    """(visible text, tool calls in the contract's form) of a completion in the template's call
    format; Malformed ("bad tool call") when a call does not parse."""
    content, parsed = parser_for(chat_format(template).turns)(text, tools)
    bad = next((c for c in parsed if c.error), None)
    if bad is not None:
        raise Malformed("bad tool call", f"{bad.name or '(no name)'}: {bad.error}")
    return content, [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed]
