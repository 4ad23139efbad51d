"""`glmtune decide` with endpoints: an API alternative behind an OpenAI-compatible server (the
reader of tests/decide/reader.py, on 127.0.0.1) whose key is read from the environment variable
named on the command line and is never written (every written file is grepped for it, though the
server echoes it into every answer); a server failing every request (exit 3, one sentence, nothing
written); a server that does not answer (exit 2, one sentence); and the base itself served."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer

import pytest

from glmtune.data.synthetic_docs import generate_doc_questions, write_documents
from tests.decide.helpers import decision_of, metric, run_cli, small_suite, trained_run, write_jsonl
from tests.decide.reader import engine

KEY = "sk-decide-test-7f3a9c1e5b"


@pytest.fixture
def serve():
    servers = []

    def start(**options) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), engine(**options))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _catalog_suite(tmp_path, n: int = 4):
    write_jsonl(tmp_path / "catalog.jsonl", generate_doc_questions(seed=0)[:n])
    return small_suite(tmp_path, [{"name": "catalog", "path": "catalog.jsonl", "scorers": ["facts"]}],
                       [{"metric": "catalog/facts/supported", "rule": "min", "threshold": 0.5}], max_new_tokens=64)


def test_the_api_key_is_sent_and_never_written(shared_results, tmp_path, serve, monkeypatch):
    run_dir = trained_run(shared_results)
    suite = _catalog_suite(tmp_path)
    write_documents(tmp_path / "docs", seed=0)
    monkeypatch.setenv("DECIDE_TEST_KEY", KEY)
    url = serve(echo_header="Authorization")  # a server that repeats the key in its answers
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", url, "--tokenizer", str(run_dir / "hf"),
                                    "--base-key-env", "DECIDE_TEST_KEY", "--docs", str(tmp_path / "docs"),
                                    "--compare", f"{url},name=api,api=chat,key-env=DECIDE_TEST_KEY,cost-per-1k=0.4",
                                    "--out", str(out)])
    assert code == 0, stdout + stderr
    decision = decision_of(out)
    answers = [e["outputs"]["api"]["text"] for e in decision["scorecard"]["examples"]]
    assert all(a.endswith("Bearer [API key redacted]") for a in answers), answers  # the server did get the key
    assert decision["verdict"]["kind"] == "retrieval"  # the reader answers from the passages in both APIs
    assert metric(decision, "catalog/facts/supported") == {"base": 0.0, "retrieval": 1.0, "api": 0.0}
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in written} >= {"decision.json", "decision.md", "decision.html", "suite.yaml"}
    assert not any(KEY.encode() in p.read_bytes() for p in written)
    assert KEY not in stdout + stderr and "DECIDE_TEST_KEY" in (out / "decision.json").read_text()


def test_a_server_failing_every_request_is_one_sentence_and_nothing_is_written(shared_results, tmp_path, serve,
                                                                                monkeypatch):
    run_dir = trained_run(shared_results)
    suite = _catalog_suite(tmp_path, 2)
    monkeypatch.setenv("DECIDE_TEST_KEY", KEY)
    broken = serve(fail_posts=True)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(["decide", str(suite), "--base", str(run_dir / "hf"), "--compare",
                                    f"{broken},name=api,key-env=DECIDE_TEST_KEY", "--retries", "0",
                                    "--out", str(out), "--device", "cpu"])
    assert code == 3 and not out.exists()
    last = stderr.splitlines()[-1]  # after the progress lines
    assert last.startswith(f"glmtune decide: could not finish: the server {broken} (api) failed every request of "
                           "set catalog: 2 requests failed so far (http 500 x2;"), stderr
    assert "(saw Bearer [API key redacted])" in last and KEY not in stdout + stderr  # the server quoted the key


def test_a_server_that_does_not_answer_is_refused_before_anything_runs(tmp_path, serve):
    suite = _catalog_suite(tmp_path, 1)
    url = serve()
    dead = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    code, _, stderr = run_cli(["decide", str(suite), "--base", url, "--tokenizer", str(tmp_path),
                               "--compare", f"{dead},name=gone", "--retries", "0", "--timeout", "5",
                               "--out", str(tmp_path / "out")])
    assert code == 2 and stderr.startswith(f"glmtune decide: error: --compare {dead}: GET /v1/models failed "
                                           "(connection after 1 attempt"), stderr
    assert stderr.count("\n") == 1 and not (tmp_path / "out").exists()


def test_a_key_variable_that_is_not_set_is_refused(tmp_path, serve, monkeypatch):
    monkeypatch.delenv("DECIDE_UNSET_KEY", raising=False)
    code, _, stderr = run_cli(["decide", str(_catalog_suite(tmp_path, 1)), "--base", str(tmp_path),
                               "--compare", f"{serve()},key-env=DECIDE_UNSET_KEY"])
    assert code == 2 and "key-env: the environment variable DECIDE_UNSET_KEY is not set (or empty)" in stderr
