"""`glmtune eval` through a real server: `transformers serve` (transformers[serving], the dev extra)
started here on 127.0.0.1 with the HF export of a short tiny run, and stopped at the end.

The run trains on the demo's data (4000 synthetic tickets, seed 0), so its validation split starts
with the 24 tickets the bundled suite evaluates (`run_split: validation, limit: 24`); the suite
here reads the same rows by path, with the bundled decoding (greedy, 64 new tokens) and the gates
on those tickets. Two scorecards share one base (the endpoint) and differ in the candidate:
in-process (the run's hf/ loaded here) and the endpoint serving those weights in `completions`
mode. Their candidate outputs must agree on at least 23 of 24 tickets and the gate verdicts on
all gates. `chat` mode then runs end to end (the engine's own template; transformers serve has no
GLM-5 tool parser, which its operations entry reports). transformers serve gives no prompt
log-probabilities: the loss metrics are "not available from this engine" for the endpoint.

A server that does not come up fails the test with its log's tail; nothing is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from glmtune.eval.endpoint import EndpointOptions
from glmtune.eval.evaluate import run_eval
from tests.train.run_helpers import WITH_EXPORT, shared_run

BUNDLED = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "eval_support_json.yaml"
DEMO_DATA = ["--data.synthetic.rows", "4000"]  # the demo recipe's own data: its validation split
START_S = 90  # the server's start (imports, the model loaded) on a busy 2-core machine


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # xdist workers share the cores (as tests/eval/test_eval_e2e.py)
    yield
    torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(hf_dir: Path, log_path: Path):
    """`transformers serve HF_DIR` on a free port; (the process, its URL) once /health answers."""
    port = _free_port()
    command = [str(Path(sys.executable).parent / "transformers"), "serve", str(hf_dir), "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--log-level", "info"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    log = log_path.open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    _stop(process)
    pytest.fail(f"transformers serve did not come up in {START_S} s (exit {process.poll()}); log tail:\n"
                + log_path.read_text()[-4000:])


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=15)


def _suite(directory: Path, run_dir: Path, limit: int = 24, max_new_tokens: int | None = None) -> Path:
    """The bundled suite's tickets set (its rows by path), decoding, general text and ticket gates."""
    suite = yaml.safe_load(BUNDLED.read_text())
    tickets = suite["sets"][0]
    assert tickets["run_split"] == "validation" and tickets["limit"] == 24
    del tickets["run_split"]
    tickets.update(path=str(next((run_dir / "data").glob("validation-*.jsonl"))), limit=limit)
    for scorer in tickets["scorers"]:
        if isinstance(scorer, dict) and "schema" in scorer:
            scorer["schema"] = str((BUNDLED.parent / scorer["schema"]).resolve())
    suite["sets"] = [tickets]
    suite["general_text"]["path"] = str(BUNDLED.parent / suite["general_text"]["path"])
    suite["gates"] = [g for g in suite["gates"] if g["metric"].split("/")[0] in ("tickets", "general_text",
                                                                                  "operations")]
    if max_new_tokens is not None:
        suite["decoding"]["max_new_tokens"] = max_new_tokens
    path = directory / f"suite-{limit}.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _same_answer(a: dict, b: dict) -> bool:
    return a["text"] == b["text"] and a["tool_calls"] == b["tool_calls"] and a["finish"] == b["finish"]


def test_endpoint_scorecard_equals_in_process(shared_results, tmp_path, one_thread):
    began = time.monotonic()
    run_dir = shared_run(shared_results, *WITH_EXPORT, *DEMO_DATA).run_dir
    process, url = _serve(run_dir / "hf", tmp_path / "serve.log")
    try:
        suite = _suite(tmp_path, run_dir)
        quiet = dict(log=lambda _: None)
        in_process, _ = run_eval(suite, url, run_dir / "hf", tmp_path / "in-process", **quiet)
        served, _ = run_eval(suite, url, url, tmp_path / "served", endpoint=EndpointOptions(tokenizer=run_dir / "hf"),
                             **quiet)
        chat, chat_dir = run_eval(_suite(tmp_path, run_dir, limit=4, max_new_tokens=16), url, url, tmp_path / "chat",
                                  endpoint=EndpointOptions(api="chat", tokenizer=run_dir / "hf"), **quiet)
    finally:
        _stop(process)
    pairs = list(zip(in_process["examples"], served["examples"]))
    assert len(pairs) == 24 and all(a["id"] == b["id"] for a, b in pairs)
    same = [a["id"] for a, b in pairs if _same_answer(a["outputs"]["candidate"], b["outputs"]["candidate"])]
    print(f"endpoint vs in-process: the same outputs on {len(same)}/24 tickets")
    assert len(same) >= 23, [(a["outputs"]["candidate"]["text"], b["outputs"]["candidate"]["text"])
                             for a, b in pairs if a["id"] not in same]
    # Operations gates (latency) are timings of two different servers, not of the weights: excepted.
    verdicts = [[(g["name"], g["passed"]) for g in card["gates"] if not g["metric"].startswith("operations/")]
                for card in (in_process, served)]
    assert verdicts[0] == verdicts[1]
    # Generation-based metrics equal; the loss metrics say the engine cannot give them.
    for a, b in zip(in_process["metrics"], served["metrics"]):
        if a["id"].startswith("tickets/") and "reference_loss" not in a["id"]:
            assert a["by_category"]["all"]["values"]["candidate"] == b["by_category"]["all"]["values"]["candidate"]
    losses = {m["id"]: m for m in served["metrics"] if m["id"].endswith("/loss")}
    assert set(losses) == {"tickets/reference_loss/loss", "general_text/loss/loss"}
    assert all(m["not_available"]["candidate"].startswith("not available from this engine") for m in losses.values())
    engine = served["operations"]["candidate"]["endpoint"]
    assert engine["failed_requests"] == 0 and engine["prompt_token_mismatches"] == 0, engine
    fingerprint = served["models"][1]["fingerprint"]
    assert fingerprint["endpoint"] == url and fingerprint["model"] == str(run_dir / "hf")
    print(f"engine: server {fingerprint['engine_server']!r}, owned_by {fingerprint['engine_owned_by']!r}, "
          f"version {fingerprint['engine_version']!r}")
    # chat: the engine's template and (no) tool parser, end to end.
    assert (chat_dir / "scorecard.json").is_file() and chat["operations"]["candidate"]["endpoint"]["api"] == "chat"
    assert chat["operations"]["candidate"]["endpoint"]["failed_requests"] == 0
    assert all(e["outputs"]["candidate"]["error"] is None for e in chat["examples"])
    print(f"chat mode: {json.dumps(chat['operations']['candidate']['endpoint'])}")
    print(f"test took {time.monotonic() - began:.1f} s")
