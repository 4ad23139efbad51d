"""A server that fails every request (issue 44, re-test): 429s with a Retry-After of 1e308, 503s, a
redirect loop, a 303 to GET /v1/models, bodies shorter than their Content-Length, answers with a
lone surrogate. `glmtune eval` exits 3 (the evaluation could not finish) saying which server
failed every request of which set and by which fault kinds, never "internal error ... run with
--debug" (a glmtune bug); a redirect loop is a "redirect" (not retried: it would loop again), and
a redirect that would turn a POST into a GET is refused as one, not read as a malformed completion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.data.tokenizer import resolve_tokenizer_dir
from tests.eval.hostile_stub import ANSWER, Server, raw, redirect, short_body

FAULTS = {  # marker: (the server's answer to every completion, the fault kinds the message names)
    "surrogate": (raw(200, b'{"choices": [{"text": "ans\\ud800wer", "finish_reason": "stop"}]}'), "malformed x3"),
    "storm": (raw(429, b"{}", Retry_After="1e308"), "http 429 x3"),
    "unavailable": (raw(503, b"{}", Retry_After="0"), "http 503 x3"),
    "loop": (redirect("/v1/completions"), "redirect x3"),
    "see-other": (raw(303, b"{}", Location="/v1/models"), "redirect x3"),
    "short": (short_body(), "connection x3"),
}


def _suite(tmp_path: Path, marker: str) -> Path:
    rows = [{"id": f"{marker}-{i}", "category": "ordinary", "must_refuse": False,
             "messages": [{"role": "user", "content": f"Ticket {marker}-{i}: my sync fails."},
                          {"role": "assistant", "content": ANSWER}]} for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "suite.yaml").write_text("name: failing\nversion: 1\ndecoding: {max_new_tokens: 8, max_tool_rounds: 0}\n"
                                         "sets:\n  - {name: t, path: rows.jsonl, scorers: [refusal]}\n")
    return tmp_path / "suite.yaml"


@pytest.mark.parametrize("marker", FAULTS)
def test_a_server_failing_every_request_is_named_with_its_fault_kinds(tmp_path, capsys, marker):
    behaviour, kinds = FAULTS[marker]
    with Server({marker: behaviour}) as server:
        status = main(["eval", str(_suite(tmp_path, marker)), "--base", server.url, "--candidate", server.url,
                       "--tokenizer", str(resolve_tokenizer_dir(None)), "--out", str(tmp_path / "eval"),
                       "--retries", "1", "--timeout", "5"])
    err = capsys.readouterr().err
    assert status == 3, err
    [line] = [line for line in err.splitlines() if line.startswith("glmtune eval:")]
    assert line.startswith(f"glmtune eval: could not finish: the server {server.url} (base) failed every request "
                           f"of set t: 3 requests failed so far ({kinds}; "), line
    assert "internal error" not in err and "--debug" not in err and not (tmp_path / "eval").exists()
    if marker == "loop":  # one attempt a request: a loop is not retried (httpx follows 20 hops, then stops)
        assert server.seen["loop"] == 3 * 21 and "Exceeded maximum allowed redirects" in line
    if marker == "see-other":  # refused before the GET it asks for: not "'choices' is a required property"
        assert "answered 303, a redirect to " in line and "/v1/models that the client would follow with a GET" in line
        assert server.seen["GET /v1/models"] == 2  # base and candidate resolving it at the start: not the redirect
    if marker in ("storm", "see-other", "surrogate"):  # not retried: the server would answer the same
        assert "after 1 attempt:" in line
