"""The server's answers read as the API defines them, and nothing else believed.

Each response body (already capped in bytes by `endpoint_http`) is parsed with its depth and
what it builds bounded (at most one array or object per `BYTES_PER_CONTAINER` bytes, beyond
`text_limits.MIN_CONTAINERS`: a parsed response then takes at most about `PARSED_BYTES_FACTOR`
x its bytes, where `[{},{},...]` took 50 x), as RFC 8259 JSON (no NaN or infinity; no lone
surrogate, which no UTF-8 encoder downstream could write), and checked against a JSON Schema of
the fields glmtune reads (jsonschema); anything missing, of the wrong type or out of range is
`MalformedResponse`, which fails that request only (counted as "malformed", the server and the
request named by `endpoint_client.call`). On top of the schema:

  * usage counts: non-negative integers, `completion_tokens` at most `max_new_tokens`. The
    scorecard's generated tokens do not come from them (`Endpoint` counts the answer's tokens
    with the suite's tokenizer); they are checked because a response that breaks them is not the
    API's;
  * a chat answer's tool calls at most `max_new_tokens` (counted before the schema walks them);
  * an answer's text (chat: its content and tool calls) at most what `max_new_tokens` tokens can
    spell: `max_new_tokens` x the tokenizer's longest token in characters (x 6 for chat, whose
    tool-call arguments the engine re-encodes as JSON, an escape taking up to 6 characters);
  * prompt log-probabilities: one a prompt token (the generated token's may follow), finite
    numbers <= 0, the first token's null or one.

Messages quote the server through `clipped`: a listing of 200,001 model ids is not echoed whole.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import jsonschema

from glmtune.eval.endpoint_http import MalformedResponse
from glmtune.io.text_limits import clipped, parse_json

# A prompt's log-probabilities, the largest answer an engine gives, hold one object (top_logprobs)
# per 30-70 bytes (a compact engine's `{"tok":-1.23}` to vLLM's full floats); 16 keeps a margin.
BYTES_PER_CONTAINER = 16
# The most memory a response takes while parsed, in multiples of its bytes (the body, its text and
# what json builds), with a margin: the worst shapes the budget lets through are an array of
# 2-character strings (14 x its bytes traced by tracemalloc; 18 x in RSS with 4 of 16 MiB in
# flight) and an object of unique 4-character keys (16 x; 16.5 x in RSS); `[{},{},...]` was 50 x.
PARSED_BYTES_FACTOR = 20
_COUNT = {"type": ["integer", "null"], "minimum": 0}
_MAX_ID = 1024  # a served model's id: a name or a path (it goes into every request and the fingerprint)
_REASON = {"type": ["string", "null"]}


def _with_choices(choice: dict[str, Any], max_new_tokens: int | None = None) -> dict[str, Any]:
    usage = {"type": ["object", "null"], "properties": {
        "prompt_tokens": _COUNT,
        "completion_tokens": {**_COUNT, **({"maximum": max_new_tokens} if max_new_tokens is not None else {})}}}
    return {"type": "object", "required": ["choices"], "properties": {
        # Only the first choice is read (n = 1): the others are not checked, nor walked.
        "choices": {"type": "array", "minItems": 1, "prefixItems": [{"type": "object", **choice}]}, "usage": usage}}


_COMPLETION_CHOICE = {"required": ["text"], "properties": {"text": {"type": "string"}, "finish_reason": _REASON}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {"function": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": ["string", "null"]}}}}}
_CHAT_CHOICE = {"required": ["message"], "properties": {"finish_reason": _REASON, "message": {
    "type": "object", "properties": {"content": {"type": ["string", "null"]},
                                     "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL}}}}}
# The two lists that may be long (a prompt's log-probabilities, a listing's models) are checked item by
# item in code (`prompt_logprobs`, `served_models`): jsonschema takes ~4-16 us an item.
_ECHO_CHOICE = {"properties": {"logprobs": {"type": ["object", "null"], "properties": {"token_logprobs": {
    "type": ["array", "null"]}}}}}
_MODELS = {"type": "object", "required": ["data"], "properties": {"data": {"type": "array"}}}
_VERSION = {"type": "object", "properties": {"version": {"type": ["string", "number", "null"]}}}


@functools.lru_cache(maxsize=32)
def _validator(kind: str, max_new_tokens: int | None) -> jsonschema.protocols.Validator:
    schema = {"completion": _with_choices(_COMPLETION_CHOICE, max_new_tokens),
              "chat": _with_choices(_CHAT_CHOICE, max_new_tokens), "echo": _with_choices(_ECHO_CHOICE),
              "models": _MODELS, "version": _VERSION}[kind]
    return jsonschema.Draft202012Validator(schema)


def read(body: bytes, kind: str, what: str, max_new_tokens: int | None = None) -> dict[str, Any]:
    """The JSON object `body`, checked against `kind`'s schema; MalformedResponse naming `what` and
    the first field at fault otherwise."""
    try:
        value = parse_json(body, what, bytes_per_container=BYTES_PER_CONTAINER, allow_nan=False)
    except ValueError as exc:
        raise MalformedResponse(clipped(exc, 300)) from None
    _check_tool_call_count(value, kind, max_new_tokens, what)
    # The best of the first few errors: a body of a million wrong items would otherwise make a million errors.
    errors = itertools.islice(_validator(kind, max_new_tokens).iter_errors(value), 16)
    error = jsonschema.exceptions.best_match(errors)
    if error is None:
        return value
    message = error.message  # it quotes the value at fault, which may be long: then the value is cut, not the why
    if len(message) > 200:
        message = f"{clipped(repr(error.instance), 80)} fails {error.validator!r}: {clipped(error.validator_value, 80)}"
    raise MalformedResponse(f"{what}: {clipped(error.json_path, 80)}: {clipped(message, 300)}")


def _check_tool_call_count(value: Any, kind: str, max_new_tokens: int | None, what: str) -> None:
    """A chat answer's tool calls, counted before the schema walks each one (~13 us a call: 430,000
    calls in 16 MiB took 5.6 s): each takes at least one of the answer's `max_new_tokens` tokens."""
    if kind != "chat" or max_new_tokens is None:
        return
    try:
        calls = value["choices"][0]["message"]["tool_calls"]
    except (KeyError, IndexError, TypeError):
        return  # not there, or not where the schema wants it: the schema says which
    if isinstance(calls, list) and len(calls) > max_new_tokens:
        raise MalformedResponse(f"{what}: $.choices[0].message.tool_calls: {len(calls):,} tool calls, more than "
                                f"{max_new_tokens} tokens can spell")


def answer_chars(max_new_tokens: int, longest_token: int, api: str) -> int:
    """The most characters an answer of `max_new_tokens` tokens can hold (module docstring)."""
    return max_new_tokens * longest_token * (6 if api == "chat" else 1)


def check_answer_length(chars: int, bound: int, max_new_tokens: int, what: str) -> None:
    if chars > bound:
        raise MalformedResponse(f"{what}: an answer of {chars:,} characters, more than {max_new_tokens} tokens can "
                                f"spell (at most {bound:,}: max_new_tokens x the tokenizer's longest token)")


def prompt_logprobs(response: dict[str, Any], num_ids: int, what: str) -> list[float] | None:
    """log p(ids[j] | ids[:j]) for j in 1..num_ids-1 from an echo response; None when the engine gave
    none (no logprobs, or an empty list); MalformedResponse for a list of another length or a value
    that is not a finite number <= 0."""
    logprobs = response["choices"][0].get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    if not values:
        return None
    if not num_ids <= len(values) <= num_ids + 1:
        raise MalformedResponse(f"{what}: {len(values):,} prompt log-probabilities for {num_ids:,} prompt tokens")
    bad = next((j for j, v in enumerate(values) if not (j == 0 and v is None or _logprob(v))), None)
    if bad is not None:
        raise MalformedResponse(f"{what}: $.choices[0].logprobs.token_logprobs[{bad}]: {clipped(repr(values[bad]), 60)} "
                                "is not a log-probability (a finite number <= 0)")
    return [float(v) for v in values[1:num_ids]]


def _logprob(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value <= 0  # type(): True is not a number


def served_models(response: dict[str, Any]) -> dict[str, str | None]:
    """{model id: owned_by} of a /v1/models listing (read with kind "models"); MalformedResponse for a
    model that is not an object with a non-empty string id and a string or null owned_by."""
    served = {}
    for i, m in enumerate(response["data"]):
        if not (isinstance(m, dict) and isinstance(m.get("id"), str) and 0 < len(m["id"]) <= _MAX_ID
                and isinstance(m.get("owned_by"), (str, type(None)))):
            raise MalformedResponse(f"GET /v1/models: $.data[{i}]: {clipped(m, 100)} is not a model (a string id "
                                    f"of 1 to {_MAX_ID} characters, a string or null owned_by)")
        served[m["id"]] = m.get("owned_by")
    return served


def listing(ids, limit: int = 8) -> str:
    """Model ids for a message: the first `limit`, each clipped, and how many more."""
    ids = list(ids)
    shown = ", ".join(clipped(i, 80) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit:,} more" if len(ids) > limit else "") if ids else "none"
