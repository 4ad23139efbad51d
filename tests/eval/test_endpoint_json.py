"""What a server's JSON may cost and hold (issue 44, re-test): a body of `[{},{},...]` costs the
client about its bytes (not 50 x), while a prompt's log-probabilities of 160k tokens still parse;
a cap x concurrency the machine cannot hold is refused before anything runs; a lone surrogate in
a model id, in GET /version or in an answer is a malformed answer, never an encode error at the
end; NaN, Infinity and 1e999 in tool-call arguments and a key given twice are refused calls in both
APIs, and the scorecard stays RFC 8259 JSON."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from glmtune.data.chat_template import bundled_template
from glmtune.data.synthetic import LOOKUP_ORDER_TOOL
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.answering import Prompting
from glmtune.eval.backends import Failed
from glmtune.eval.endpoint import Endpoint, EndpointOptions, resolve_endpoint
from glmtune.eval.endpoint_http import DEFAULT_MAX_RESPONSE_BYTES
from glmtune.eval.endpoint_responses import prompt_logprobs, read
from glmtune.eval.evaluate import run_eval
from glmtune.eval.suite import DecodingConfig
from tests.eval.hostile_stub import ANSWER, Server, chat, completion, raw, reply

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def prompting() -> Prompting:
    return Prompting(load_tokenizer(), bundled_template(), False, DecodingConfig(max_new_tokens=MAX_NEW_TOKENS))


def test_a_json_bomb_costs_the_client_about_its_bytes(prompting):
    bomb = b'{"choices": [{"text": "x"}], "junk": [' + b"{}," * 350_000 + b"{}]}"  # 1 MiB, 350,005 containers
    options = EndpointOptions(concurrency=1)
    with Server({"bomb": raw(200, bomb)}) as server:
        endpoint = Endpoint(resolve_endpoint(server.url, "candidate", options), options)
        try:
            endpoint.answer([([{"role": "user", "content": "warm-up"}], None)], prompting, 0)  # imports, connection
            tracemalloc.start()
            try:
                [result], _ = endpoint.answer([([{"role": "user", "content": "bomb"}], None)], prompting, 0)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        finally:
            endpoint.close()
    assert isinstance(result, Failed), result  # parsed, it answered "x"
    assert "350,005 JSON arrays and objects in 1,050,042 bytes, more than the 65,627 allowed" in str(result.error)
    assert peak < 4 * len(bomb), f"{peak:,} bytes at the peak for a {len(bomb):,}-byte answer"  # parsed: ~45 MiB


@pytest.mark.parametrize("compact", [False, True], ids=["vllm", "compact"])
def test_a_prompt_of_160k_tokens_still_parses(compact):
    """vLLM's echo: offsets, full-precision log-probabilities, tokens and one top_logprobs object a
    token (~70 bytes a token); a compact engine's with rounded values (~33 bytes an object)."""
    n, value = 160_000, -1.23 if compact else -1.2345678806304932
    logprobs = {"text_offset": list(range(n)), "token_logprobs": [None] + [value] * (n - 1),
                "tokens": ["\u0120the"] * n, "top_logprobs": [None] + [{"\u0120the": value} for _ in range(n - 1)]}
    body = json.dumps({"choices": [{"index": 0, "text": "x", "logprobs": logprobs}]},
                      separators=(",", ":") if compact else None).encode()
    assert len(body) < DEFAULT_MAX_RESPONSE_BYTES
    values = prompt_logprobs(read(body, "echo", "POST /v1/completions (echo)"), n, "POST")
    assert len(values) == n - 1 and values[0] == value


def test_a_cap_times_concurrency_over_the_machine_is_refused_first():
    with pytest.raises(ValueError, match=r"^--max-response-bytes 1,073,741,824 x --concurrency 1024: the responses in "
                                         r"flight could take 20,480\.0 GiB while parsed \(up to 20 x their bytes each\)"
                                         r", more than this machine's [0-9,.]+ GiB; lower either$"):
        EndpointOptions(max_response_bytes=1 << 30, concurrency=1024).check("http://h:1/v1", "runs/x")
    EndpointOptions(concurrency=8).check("http://h:1/v1", "runs/x")  # the defaults: 2.5 GiB


def _suite(tmp_path: Path, rows: list[str], tools: bool = False) -> Path:
    lines = [{"id": name, "category": "ordinary", "must_refuse": False,
              "messages": [{"role": "user", "content": f"Ticket {name}: order ORD-1"},
                           {"role": "assistant", "content": ANSWER}],
              **({"tools": [LOOKUP_ORDER_TOOL]} if tools else {})} for name in rows]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    registered = "tools: {functions: {lookup_order: 'glmtune.data.synthetic:lookup_order'}}\n" if tools else ""
    (tmp_path / "suite.yaml").write_text(
        f"name: hostile\nversion: 1\ndecoding: {{max_new_tokens: {MAX_NEW_TOKENS}, max_tool_rounds: 1}}\n{registered}"
        "sets:\n  - {name: t, path: rows.jsonl, scorers: [refusal]}\n")
    return tmp_path / "suite.yaml"


def _strict(text: str):
    """json.loads as an RFC 8259 reader (jq, JSON.parse): no NaN or Infinity."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_lone_surrogate_in_a_model_id_is_a_malformed_listing():
    models = [{"id": "m\ud800<script>|x\x1b[32mGREEN", "owned_by": "o\ud801"}]
    with Server({}, models=lambda handler, _: reply(handler, 200, {"object": "list", "data": models})) as server, \
            pytest.raises(ValueError) as refused:
        resolve_endpoint(server.url, "candidate", EndpointOptions())
    message = str(refused.value)
    assert message.startswith(f"--candidate {server.url}: GET /v1/models failed (malformed after 1 attempt: ")
    assert "not valid Unicode: lone surrogate \\ud800 escaped in a JSON string" in message
    message.encode("utf-8")  # printable at once: no encode error when it is printed


def test_a_lone_surrogate_in_the_engine_version_is_no_version(tmp_path):
    def version(handler, _):
        reply(handler, 200, {"version": "v\ud800\x1b[31mRED"})

    with Server({}, version=version) as server:
        card, out = run_eval(_suite(tmp_path, ["a", "b"]), server.url, server.url, tmp_path / "eval",
                             endpoint=EndpointOptions(tokenizer=resolve_tokenizer_dir(None)), log=lambda _: None)
    assert server.seen["GET /version"] == 2
    assert [m["fingerprint"]["engine_version"] for m in card["models"]] == [None, None]
    assert _strict((out / "scorecard.json").read_text(encoding="utf-8"))["passed"]


def test_a_lone_surrogate_in_one_answer_fails_that_request_as_malformed(tmp_path):
    surrogate = raw(200, b'{"choices": [{"text": "ans\\ud800wer \\u001b[31m<img src=x>", "finish_reason": "stop"}]}')
    with Server({"odd": surrogate}) as server:
        card, out = run_eval(_suite(tmp_path, ["odd", "fine"]), server.url, server.url, tmp_path / "eval",
                             endpoint=EndpointOptions(tokenizer=resolve_tokenizer_dir(None)), log=lambda _: None)
    examples = {e["id"]: e["outputs"]["candidate"] for e in card["examples"]}
    assert examples["odd"]["error"].startswith("generation failed: RequestFailed: malformed after 1 attempt: ")
    assert "lone surrogate \\ud800" in examples["odd"]["error"] and examples["fine"]["text"] == ANSWER
    assert card["operations"]["candidate"]["endpoint"]["failures"] == {"malformed": 1}
    _strict((out / "scorecard.json").read_text(encoding="utf-8"))


def _call(arguments: str) -> dict:
    return {"id": "a", "type": "function", "function": {"name": "lookup_order", "arguments": arguments}}


NAN_MARKUP = ("<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-1</arg_value><arg_key>x</arg_key>"
              "<arg_value>{}</arg_value></tool_call>")
CASES = {  # row marker (none inside another): (completions answer, chat message, what the refused call says)
    "nan": (NAN_MARKUP.format("NaN"), {"content": None, "tool_calls": [_call('{"order_id": "ORD-1", "x": NaN}')]},
            "a number that is not finite (nan"),
    "inf": (NAN_MARKUP.format("1e999"), {"content": None, "tool_calls": [_call('{"order_id": "ORD-1", "x": 1e999}')]},
            "a number that is not finite (inf"),
    "negative": (NAN_MARKUP.format('{"y": [-Infinity]}'),
                  {"content": None, "tool_calls": [_call('{"order_id": "ORD-1", "x": {"y": [-Infinity]}}')]},
                  "a number that is not finite (-inf"),
    "twice": (NAN_MARKUP.format('{"a": 1, "a": 2}'),
              {"content": None, "tool_calls": [_call('{"order_id": "ORD-1", "order_id": {"a": 1}}')]}, "given twice"),
}


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_non_finite_or_repeated_arguments_are_refused_calls_and_the_scorecard_stays_json(tmp_path, api):
    behaviours = {marker: completion(text) if api == "completions" else chat(message)
                  for marker, (text, message, _) in CASES.items()}
    with Server(behaviours) as server:
        card, out = run_eval(_suite(tmp_path, list(CASES), tools=True), server.url, server.url, tmp_path / "eval",
                             endpoint=EndpointOptions(api=api, tokenizer=resolve_tokenizer_dir(None)),
                             log=lambda _: None)
    examples = {e["id"]: e["outputs"]["candidate"] for e in card["examples"]}
    for marker, (_, _, says) in CASES.items():
        assert examples[marker]["finish"] == "bad_tool_call", (marker, examples[marker])
        [call] = examples[marker]["tool_calls"]
        assert call["arguments"] is None and says in call["error"], (marker, call)
    strict = _strict((out / "scorecard.json").read_text(encoding="utf-8"))
    assert strict["examples"][0]["outputs"]["candidate"]["tool_calls"][0]["arguments"] is None
