"""An endpoint that attacks the evaluation (issue 44): a hostile stub server (hostile_stub.py) sends
a huge body, drips its answer a byte at a time, redirects to another server, reports usage counts
that are negative, fractional or huge, puts "abc" among the prompt log-probabilities and lists
200,001 models. Each is one request's counted failure (or, for the listing, a short error); the
memory, the time, the token counts and the messages stay bounded, and the evaluation finishes
with its normal exit status."""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.data.chat_template import bundled_template
from glmtune.data.tokenizer import load_tokenizer, resolve_tokenizer_dir
from glmtune.eval.answering import Prompting
from glmtune.eval.backends import Failed, Turn
from glmtune.eval.endpoint import Endpoint, EndpointOptions, resolve_endpoint
from glmtune.eval.evaluate import run_eval
from glmtune.eval.suite import DecodingConfig
from tests.eval.hostile_stub import (ANSWER, DRIP_FOR_S, Server, chat, completion, drip, echo_logprobs, huge, raw,
                                     redirect, reply)

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def prompting() -> Prompting:
    return Prompting(load_tokenizer(), bundled_template(), False, DecodingConfig(max_new_tokens=MAX_NEW_TOKENS))


def _answer(url: str, prompting: Prompting, markers: list[str], **options) -> tuple[list[Turn | Failed], dict]:
    """Endpoint.answer on one request per marker; (the results, the operations' endpoint entry)."""
    options = EndpointOptions(**{"concurrency": 4, **options})
    endpoint = Endpoint(resolve_endpoint(url, "candidate", options), options)
    try:
        results, _ = endpoint.answer([([{"role": "user", "content": f"Ticket {m}"}], None) for m in markers],
                                     prompting, 0)
        return results, endpoint.operations([], 0, 0.0)["endpoint"]
    finally:
        endpoint.close()


def _error(result: Turn | Failed) -> str:
    assert isinstance(result, Failed), result
    return str(result.error)


def test_a_huge_body_fails_its_request_and_is_not_read(prompting):
    cap = 64 << 10
    behaviours = {"huge-stated": huge(48 << 20, stated=True), "huge-streamed": huge(48 << 20, stated=False),
                  "long-text": completion("word " * 10_000)}  # 50 kB: under the cap, over 8 tokens' worth
    with Server(behaviours, version=huge(48 << 20, stated=False)) as server:
        _answer(server.url, prompting, ["warm-up"])  # the client's imports and first connection: not measured
        tracemalloc.start()
        try:
            results, ops = _answer(server.url, prompting, ["huge-stated", "huge-streamed", "long-text", "ok"],
                                   max_response_bytes=cap)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 8 << 20, f"{peak:,} bytes allocated at the peak for a 48 MiB answer under a 64 KiB cap"
    assert server.sent["/v1/completions"] < 24 << 20  # the client left: what TCP buffers held, not 48 MiB
    assert server.sent["/version"] < 24 << 20 and server.seen["GET /version"] == 2  # the engine's version: none
    assert "states 50,331,648 bytes, over the 65,536-byte cap (--max-response-bytes)" in _error(results[0])
    assert "passed the 65,536-byte cap (--max-response-bytes); the rest was not read" in _error(results[1])
    assert "an answer of 50,000 characters, more than 8 tokens can spell" in _error(results[2])
    assert isinstance(results[3], Turn) and results[3].text == ANSWER
    assert ops["failures"] == {"malformed": 1, "too large": 2} and ops["max_response_bytes"] == cap
    assert ops["http_requests"] == 4 and ops["retries"] == 0  # not retried: the server would answer the same


def test_a_drip_is_cut_at_the_request_deadline(prompting):
    timeout, retries = 1.0, 1  # the request's deadline: timeout x (retries + 1) = 2 s
    with Server({"drip-body": drip(headers=False), "drip-headers": drip(headers=True)}) as server:
        done: dict = {}

        def run() -> None:
            began = time.monotonic()
            done["results"], done["ops"] = _answer(server.url, prompting, ["drip-body", "drip-headers"],
                                                   timeout_s=timeout, retries=retries)
            done["seconds"] = time.monotonic() - began

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(DRIP_FOR_S / 2)  # a per-read timeout never fires on a drip: the old code waits it out
        assert not thread.is_alive(), f"a dripping server held the requests over {DRIP_FOR_S / 2} s"
    bound = timeout * (retries + 1)
    # GET /v1/models and /version before them, and a busy machine's scheduling: the drip lasts 30 s
    assert done["seconds"] < bound + 3.0, done["seconds"]
    for result in done["results"]:
        assert _error(result).startswith("timeout after 2 attempts: APITimeoutError: Request timed out.: ")
        assert "no complete response within the deadline" in _error(result)
    assert server.seen["drip-body"] == server.seen["drip-headers"] == 2  # the retry, cut by the request's deadline
    assert done["ops"]["failures"] == {"timeout": 2}


def _completion_with(**choice) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": ANSWER, "finish_reason": "stop", **choice}]}).encode()


MALFORMED = {  # marker: (the answer, what the failure says)
    "not-json": (raw(200, b"garbage"), "not valid JSON"),
    "not-utf8": (raw(200, b'{"choices": [{"text": "\xff"}]}'), "not valid JSON"),
    "deep": (raw(200, b"[" * 10_000), "nested deeper than 64 levels"),
    "bomb": (raw(200, b'{"choices": [{"text": "x"}], "junk": [' + b"{}," * 70_000 + b"{}]}"),
             "70,005 JSON arrays and objects in 210,042 bytes, more than the 65,536 allowed"),
    "lone-surrogate": (raw(200, b'{"choices": [{"text": "ans\\ud800wer"}]}'),
                       "not valid Unicode: lone surrogate \\ud800 escaped in a JSON string"),
    "nan-usage": (raw(200, _completion_with().replace(b'"stop"}]', b'"stop"}], "usage": {"prompt_tokens": NaN}')),
                  "a number that is not finite (nan: NaN, Infinity or beyond a float"),
    "no-choices": (raw(200, b'{"choices": []}'), "$.choices: [] should be non-empty"),
    "text-number": (raw(200, _completion_with(text=5)), "$.choices[0].text: 5 is not of type 'string'"),
    "reason-object": (raw(200, _completion_with(finish_reason={"a": 1})), "$.choices[0].finish_reason: "),
    "gzip": (raw(200, _completion_with(), Content_Encoding="gzip"), "a body in Content-Encoding 'gzip' though "
                                                                     "identity was asked"),
    "bad-location": (raw(307, b"{}", Location="http://[::1"), "a 307 redirect to http://[::1, which is not a URL"),
}


def test_a_malformed_answer_of_any_kind_fails_its_request_only(prompting):
    behaviours = {marker: answer for marker, (answer, _) in MALFORMED.items()}
    behaviours["nan-retry"] = raw(429, b"{}", Retry_After="nan")  # waits the backoff, not time.sleep(nan)
    with Server(behaviours) as server:
        results, ops = _answer(server.url, prompting, [*MALFORMED, "nan-retry", "ok"], retries=1)
    for (marker, (_, says)), result in zip(MALFORMED.items(), results):
        assert _error(result).startswith("malformed after 1 attempt: "), (marker, _error(result))
        assert says in _error(result) and f"(server {server.url}, request glmtune-" in _error(result), marker
    assert _error(results[-2]).startswith("http 429 after 2 attempts: ")
    assert isinstance(results[-1], Turn) and results[-1].text == ANSWER
    assert ops["failures"] == {"http 429": 1, "malformed": len(MALFORMED)}


def _suite(tmp_path: Path, rows: list[str], scorers: str = "[refusal]", general_text: str | None = None) -> Path:
    lines = [{"id": name, "category": "ordinary", "must_refuse": False,
              "messages": [{"role": "user", "content": f"Ticket {name}: my sync fails."},
                           {"role": "assistant", "content": ANSWER}]} for name in rows]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = ""
    if general_text is not None:
        (tmp_path / "prose.txt").write_text(general_text)
        text = "general_text: {path: prose.txt, max_tokens: 192, window: 32}\n"
    (tmp_path / "suite.yaml").write_text(
        f"name: hostile\nversion: 1\ndecoding: {{max_new_tokens: {MAX_NEW_TOKENS}, max_tool_rounds: 0}}\n"
        f"sets:\n  - {{name: t, path: rows.jsonl, scorers: {scorers}}}\n{text}")
    return tmp_path / "suite.yaml"


def _examples(card: dict, label: str = "candidate") -> dict:
    return {e["id"]: e["outputs"][label] for e in card["examples"]}


def test_a_redirect_off_the_origin_is_refused_and_the_other_server_gets_nothing(tmp_path):
    with Server({}) as elsewhere:
        moved = redirect(elsewhere.url + "/completions")
        with Server({"moved": moved}, models=redirect(elsewhere.url + "/models")) as listing, \
                Server({"moved": moved}) as server:
            with pytest.raises(ValueError) as refused:
                resolve_endpoint(listing.url, "base", EndpointOptions())
            card, _ = run_eval(_suite(tmp_path, ["ok", "moved"]), server.url, server.url, tmp_path / "eval",
                               endpoint=EndpointOptions(tokenizer=resolve_tokenizer_dir(None)), log=lambda _: None)
    message = str(refused.value)
    assert message.startswith(f"--base {listing.url}: GET /v1/models failed (redirect after 1 attempt: ")
    assert f"{listing.url}/models answered 307, a redirect to {elsewhere.url}/models, off the endpoint's origin" in message
    assert elsewhere.seen == {}  # neither the listing nor any prompt reached it
    examples = _examples(card)
    assert examples["ok"]["passed"] and not examples["moved"]["passed"]
    assert f"a redirect to {elsewhere.url}/completions, off the endpoint's origin" in examples["moved"]["error"]
    port = server.url.split(":")[2][:-3]
    assert card["operations"]["candidate"]["endpoint"]["failures"] == {"redirect": 1}
    assert card["operations"]["candidate"]["endpoint"]["answered_by"] == [f"127.0.0.1:{port}"]
    assert card["models"][1]["fingerprint"]["answered_by"] == f"127.0.0.1:{port}"


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 20, "completion_tokens": -5}, {"prompt_tokens": 20, "completion_tokens": 2.5},
    {"prompt_tokens": 20, "completion_tokens": "7"}, {"prompt_tokens": 20, "completion_tokens": 10 ** 12},
    {"prompt_tokens": -1, "completion_tokens": 3}, {"prompt_tokens": 20, "completion_tokens": True}])
def test_usage_counts_cannot_game_the_tokens(tmp_path, usage):
    with Server({"lying": completion(usage=usage), "honest-usage": completion(
            usage={"prompt_tokens": 20, "completion_tokens": MAX_NEW_TOKENS})}) as server:
        card, _ = run_eval(_suite(tmp_path, ["lying", "honest-usage", "plain"]), server.url, server.url,
                           tmp_path / "eval", endpoint=EndpointOptions(tokenizer=resolve_tokenizer_dir(None)),
                           log=lambda _: None)
    ops = card["operations"]["candidate"]
    examples = _examples(card)
    assert "RequestFailed: malformed after 1 attempt" in examples["lying"]["error"]
    assert "$.usage." in examples["lying"]["error"]
    assert ops["endpoint"]["failures"] == {"malformed": 1}
    # The two answers' tokens as the suite's tokenizer counts them (12 for ANSWER), at most max_new_tokens.
    assert ops["generated_tokens"] == 2 * MAX_NEW_TOKENS
    assert 0 < ops["generated_tokens_per_s"] < float("inf")


PROSE = ("Rivers run to the sea and the sea does not fill. " * 3 + "The POISON word sits here. "
         + "Winds go south and turn again to the north. " * 6)


def test_abc_in_the_prompt_logprobs_fails_that_request_only(tmp_path, capsys):
    poisoned = echo_logprobs(index=3, value="abc")
    with Server({"POISON": poisoned}) as server:
        suite = _suite(tmp_path, ["POISON-row", "fine-1", "fine-2"], "[refusal, reference_loss]", PROSE)
        status = main(["eval", str(suite), "--base", server.url, "--candidate", server.url, "--tokenizer",
                       str(resolve_tokenizer_dir(None)), "--out", str(tmp_path / "eval"), "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err  # no gates: the evaluation finished
    card = json.loads(captured.out)
    for label in ("base", "candidate"):
        examples = _examples(card, label)
        [failure] = [f for f in examples["POISON-row"]["failures"] if "reference loss" in f]
        assert failure.startswith("reference loss not computed: RequestFailed: malformed after 1 attempt: ")
        assert "$.choices[0].logprobs.token_logprobs[3]: 'abc' is not a log-probability" in failure
        assert f"(server {server.url}, request glmtune-" in failure
        assert not any("reference loss" in f for e in ("fine-1", "fine-2") for f in examples[e]["failures"])
        ops = card["operations"][label]["endpoint"]
        windows = server.seen["POISON"] // 2 - 2  # per model: the row's generation and echo, the windows
        assert windows >= 1 and ops["failures"] == {"malformed": 1 + windows}
        assert ops["prompt_logprobs"] == "available"
    metrics = {m["id"]: m for m in card["metrics"]}
    assert metrics["t/reference_loss/loss"]["by_category"]["all"]["values"]["candidate"] == pytest.approx(1.0)
    general = metrics["general_text/loss/loss"]
    assert general["by_category"]["all"]["values"] == {"base": None, "candidate": None}
    assert general["not_available"]["candidate"].startswith(
        f"general-text loss not computed: {windows} of 6 windows failed (first: malformed after 1 attempt")


def test_a_listing_of_200001_models_gives_a_short_error():
    ids = [{"id": f"model-{i:06d}", "object": "model", "owned_by": "x"} for i in range(200_001)]
    with Server({}, models=lambda handler, _: reply(handler, 200, {"object": "list", "data": ids})) as server:
        with pytest.raises(ValueError) as several:
            resolve_endpoint(server.url, "candidate", EndpointOptions())
        with pytest.raises(ValueError) as unknown:
            resolve_endpoint(server.url, "candidate", EndpointOptions(candidate_model="other"))
        with pytest.raises(ValueError) as too_large:
            resolve_endpoint(server.url, "candidate", EndpointOptions(max_response_bytes=1 << 20))
    assert str(several.value).startswith(f"--candidate {server.url} serves 200,001 models (model-000000, ")
    assert "and 199,993 more); name one with --candidate-model" in str(several.value)
    assert "and 199,993 more" in str(unknown.value)
    assert len(str(several.value)) < 500 and len(str(unknown.value)) < 500
    assert str(too_large.value).startswith(f"--candidate {server.url}: GET /v1/models failed (too large after 1 "
                                           "attempt: ResponseTooLarge: GET ")
    assert "over the 1,048,576-byte cap (--max-response-bytes)" in str(too_large.value)


def test_failed_requests_keep_nothing_of_their_responses(prompting):
    """A failed request keeps its reason, not its parsed response (through the fault's traceback):
    the memory held after failures does not grow with the failed rows."""
    long_text = completion("word " * 400_000)  # 2 MB: under the cap, over what 8 tokens can spell
    markers = [f"long-{i}" for i in range(8)]
    with Server({marker: long_text for marker in markers}) as server:
        _answer(server.url, prompting, ["warm-up"])  # the client's imports and first connection: not measured
        tracemalloc.start()
        try:
            results, ops = _answer(server.url, prompting, markers, max_response_bytes=4 << 20, concurrency=2)
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
    assert ops["failures"] == {"malformed": len(markers)}
    for result in results:
        assert "more than 8 tokens can spell" in _error(result)
        assert result.error.__cause__ is None and result.error.__context__ is None
    assert held < 2 << 20, f"{held:,} bytes still held after 8 failed requests of 2 MB each"


def test_a_flood_of_tool_calls_is_refused_before_the_schema_walks_it(prompting):
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(50_000)]
    with Server({"flood": chat({"content": None, "tool_calls": calls})}) as server:
        results, ops = _answer(server.url, prompting, ["flood", "ok"], api="chat")
    assert "$.choices[0].message.tool_calls: 50,000 tool calls, more than 8 tokens can spell" in _error(results[0])
    assert isinstance(results[1], Turn) and results[1].text == ANSWER
    assert ops["failures"] == {"malformed": 1}
