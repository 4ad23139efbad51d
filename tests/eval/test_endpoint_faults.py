"""An endpoint that misbehaves: a stub OpenAI-compatible server (http.server in a thread) answers
each row's request with a fault chosen by the row: 500s, a 429 then success, a timeout (it sleeps
past --timeout), malformed JSON, a dropped connection. `glmtune eval` finishes; each fault is a
failed example (or, retried, a passed one), counted and named in the operations, with retries
bounded in count and in time; the teacher-forced metrics the stub cannot give are "not available
from this engine", not zeros and not failed rows. Plus the options' one-line refusals."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from glmtune.data.tokenizer import resolve_tokenizer_dir
from tests.eval.hostile_stub import reply
from glmtune.eval.endpoint import EndpointOptions, _engine_calls, chat_messages
from glmtune.eval.evaluate import run_eval

TIMEOUT_S = 1.0  # --timeout; the "timeout" row sleeps past it
FAULTS = ["ok-1", "ok-2", "fault-500", "fault-429", "fault-timeout", "fault-malformed", "fault-drop"]


class _Stub(BaseHTTPRequestHandler):
    seen: Counter = Counter()  # requests per fault name

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _json(self, status: int, body: dict, **headers: str) -> None:
        reply(self, status, body, **headers)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model", "object": "model", "owned_by": "tests"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not isinstance(body["prompt"], str):  # token ids with echo: prompt log-probabilities are not offered
            return self._json(400, {"error": {"message": "prompt must be a string"}})
        fault = next(name for name in FAULTS if name in body["prompt"])
        _Stub.seen[fault] += 1
        if fault == "fault-500":
            return self._json(500, {"error": {"message": "engine crashed"}}, Retry_After="0")
        if fault == "fault-429" and _Stub.seen[fault] % 2 == 1:  # each model's first try
            return self._json(429, {"error": {"message": "slow down"}}, Retry_After="0")
        if fault == "fault-timeout":
            time.sleep(TIMEOUT_S + 0.5)
        if fault == "fault-malformed":
            data = b'{"choices": [{"text": "cut'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        if fault == "fault-drop":
            self.close_connection = True
            return self.connection.close()  # no status line: the client sees the connection go
        self._json(200, {"id": "c", "object": "text_completion", "created": 0, "model": "stub-model",
                         "choices": [{"index": 0, "text": "Sure, here is the answer.", "finish_reason": "stop",
                                      "logprobs": None}]})


@pytest.fixture
def stub_url():
    _Stub.seen = Counter()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _suite(tmp_path: Path) -> Path:
    rows = [{"id": name, "category": "ordinary", "must_refuse": False,
             "messages": [{"role": "user", "content": f"Ticket {name}: my sync fails."},
                          {"role": "assistant", "content": "Sure, here is the answer."}]} for name in FAULTS]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "prose.txt").write_text("Plain prose about rivers and the sea, written for this test. " * 20)
    (tmp_path / "suite.yaml").write_text(
        "name: faults\nversion: 1\ndecoding: {max_new_tokens: 8, max_tool_rounds: 0}\n"
        "sets:\n  - {name: t, path: rows.jsonl, scorers: [refusal, reference_loss]}\n"
        "general_text: {path: prose.txt, max_tokens: 64, window: 32}\n"
        "gates:\n  - {name: loss improves, metric: t/reference_loss/loss, rule: improves}\n")
    return tmp_path / "suite.yaml"


def _run_bounded(seconds: float, **kwargs) -> dict:
    """run_eval in a thread that must end within `seconds` (nothing may hang)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(card=run_eval(**kwargs)[0]), daemon=True)
    began = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"glmtune eval still running after {seconds} s"
    result["seconds"] = time.monotonic() - began
    return result


def test_faults_are_counted_named_and_bounded(tmp_path, stub_url):
    options = EndpointOptions(concurrency=4, timeout_s=TIMEOUT_S, retries=2, tokenizer=resolve_tokenizer_dir(None))
    done = _run_bounded(60, suite_path=_suite(tmp_path), base_arg=stub_url, candidate_arg=stub_url,
                        out=tmp_path / "eval", endpoint=options, log=lambda _: None)
    card = done["card"]
    # Per model: the 500 three times (two retries), the 429 once then success, the timeout twice (its
    # second retry would start after timeout x (retries + 1) = 3 s), the malformed reply once (not
    # retried), the dropped connection three times.
    assert _Stub.seen == {"ok-1": 2, "ok-2": 2, "fault-500": 6, "fault-429": 4, "fault-timeout": 4,
                          "fault-malformed": 2, "fault-drop": 6}
    for label in ("base", "candidate"):
        ops = card["operations"][label]
        failed_examples = ops["endpoint"].pop("failed_examples")
        assert len(failed_examples) == 4 and all(f"(server {stub_url}, request glmtune-" in m for m in failed_examples)
        assert ops["endpoint"] == {
            "api": "completions", "model": "stub-model", "concurrency": 4, "timeout_s": TIMEOUT_S, "max_retries": 2,
            "max_response_bytes": 16 << 20, "answered_by": [f"127.0.0.1:{stub_url.split(':')[2][:-3]}"],
            "http_requests": 13, "retries": 6, "failed_requests": 4,
            "failures": {"connection": 1, "http 500": 1, "malformed": 1, "timeout": 1},
            "faults": {"connection": 3, "http 429": 1, "http 500": 3, "malformed": 1, "timeout": 2},
            "prompt_token_mismatches": 0, "unparsed_tool_markup": 0,
            "prompt_logprobs": "not available from this engine: /v1/completions with token ids and echo refused "
                               "(http 400)"}
        assert ops["peak_memory_gib"] is None and "engine's process" in ops["peak_memory_note"]
        assert ops["requests"] == 7 and ops["p95_s"] < 2 * TIMEOUT_S * 3
    examples = {e["id"]: e["outputs"]["candidate"] for e in card["examples"]}
    assert [i for i, e in examples.items() if e["passed"]] == ["ok-1", "ok-2", "fault-429"]
    assert examples["fault-500"]["error"].startswith("generation failed: RequestFailed: http 500 after 3 attempts")
    assert examples["fault-timeout"]["error"].startswith("generation failed: RequestFailed: timeout after 2 attempts")
    assert examples["fault-malformed"]["error"].startswith("generation failed: RequestFailed: malformed after 1 ")
    assert examples["fault-drop"]["error"].startswith("generation failed: RequestFailed: connection after 3 ")
    # The teacher-forced metrics: null with the reason, in the metric, the gate and the reports.
    metrics = {m["id"]: m for m in card["metrics"]}
    for metric_id in ("t/reference_loss/loss", "general_text/loss/loss"):
        assert metrics[metric_id]["by_category"]["all"]["values"] == {"base": None, "candidate": None}
        assert metrics[metric_id]["not_available"]["candidate"].startswith("not available from this engine")
    assert not any("reference loss" in f for e in examples.values() for f in e["failures"])
    [gate] = card["gates"]
    assert not gate["passed"] and "not available from this engine (null)" in gate["message"]
    markdown = (tmp_path / "eval" / "scorecard.md").read_text()
    assert "n/a (not available from this engine)" in markdown and "faults: connection x3" in markdown
    assert "n/a (not available from this engine)" in (tmp_path / "eval" / "scorecard.html").read_text()
    assert card["models"][1]["fingerprint"] == {"endpoint": stub_url, "model": "stub-model", "api": "completions",
                                                "engine_server": "BaseHTTP/0.6 Python/" + _python(),
                                                "engine_owned_by": "tests", "engine_version": None,
                                                "answered_by": f"127.0.0.1:{stub_url.split(':')[2][:-3]}"}


def _python() -> str:
    import platform

    return platform.python_version()


def test_engine_tool_calls_and_chat_history():
    def Call(name, arguments):  # noqa: N802 (reads as the chat API's object)
        return {"type": "function", "function": {"name": name, "arguments": arguments}}

    parsed = _engine_calls([Call("lookup_order", '{"order_id": "A-1"}'), Call("lookup_order", '{"order_id": '),
                            Call("lookup_order", "[1]")])
    assert (parsed[0].arguments, parsed[0].error) == ({"order_id": "A-1"}, None)
    assert parsed[1].arguments is None and parsed[1].error.startswith("arguments are not JSON")
    assert parsed[2].error == "arguments are not a JSON object"
    history = chat_messages([
        {"role": "user", "content": "where is A-1?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup_order", "arguments": {"order_id": "A-1"}}}]},
        {"role": "tool", "content": '{"product": "PayFlow"}'}])
    assert history[1]["tool_calls"] == [{"id": "call_1_0", "type": "function", "function": {
        "name": "lookup_order", "arguments": '{"order_id": "A-1"}'}}]
    assert history[2]["tool_call_id"] == "call_1_0"


@pytest.mark.parametrize("options, base, message", [
    (EndpointOptions(api="chat"), "/m", "--api applies to an endpoint model"),
    (EndpointOptions(concurrency=0), "/m", "--concurrency 0: expected an integer from 1"),
    (EndpointOptions(timeout_s=0.0), "http://127.0.0.1:9/v1", "--timeout 0.0: expected seconds above 0"),
    (EndpointOptions(base_model="x"), "/m", "--base-model names a served model, but --base /m is not an endpoint"),
    (EndpointOptions(max_response_bytes=100), "http://127.0.0.1:9/v1",
     "--max-response-bytes 100: expected bytes from 1024 to 1073741824"),
    (EndpointOptions(max_response_bytes=1 << 31), "http://127.0.0.1:9/v1", "--max-response-bytes 2147483648: "),
    (EndpointOptions(max_response_bytes=4096), "/m", "--max-response-bytes applies to an endpoint model"),
])
def test_endpoint_options_refused_in_one_line(options, base, message):
    with pytest.raises(ValueError, match=message):
        options.check(base, "/c")


def test_several_served_models_need_a_name(tmp_path, stub_url, monkeypatch):
    from glmtune.eval.endpoint import resolve_endpoint

    with pytest.raises(ValueError, match="--candidate-model other: .* serves stub-model"):
        resolve_endpoint(stub_url, "candidate", EndpointOptions(candidate_model="other"))
    with pytest.raises(ValueError, match=r"--base http://127.0.0.1:1/v1: GET /v1/models failed \(connection"):
        resolve_endpoint("http://127.0.0.1:1/v1", "base", EndpointOptions(retries=0, timeout_s=2))
    with pytest.raises(ValueError, match="an endpoint is http"):
        resolve_endpoint("http://127.0.0.1:1/api", "base", EndpointOptions())


def test_cli_refuses_endpoint_options_without_an_endpoint(tmp_path, capsys):
    from glmtune.cli import main

    suite = _suite(tmp_path)
    assert main(["eval", str(suite), "--base", str(tmp_path), "--candidate", str(tmp_path), "--concurrency", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--concurrency applies to an endpoint model (--base, --candidate or a --compare http(s)://HOST:PORT/v1)" in err
    assert len(err.splitlines()) == 1
