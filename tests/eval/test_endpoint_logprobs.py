"""Teacher-forced metrics from an engine's prompt log-probabilities (as vLLM gives them:
/v1/completions with token ids, echo and logprobs) equal the in-process ones. A stub server
holds the tiny model and answers with its log-probabilities; the scorecard's base is the same
weights loaded in-process, so the reference loss of every row and the general-text loss must
agree (the target alignment: logprob j scores token j given the ones before it)."""

from __future__ import annotations

import json
import shutil
import threading
from http.server import ThreadingHTTPServer

import pytest

from glmtune import save_pretrained
from glmtune.data.tokenizer import resolve_tokenizer_dir
from glmtune.eval.evaluate import run_eval
from glmtune.models.glm5 import build_model, get_preset
from tests.eval.endpoint_stub import engine


@pytest.fixture
def served_tiny(tmp_path):
    model = build_model(get_preset("tiny"), seed=0).eval()
    hf_dir = tmp_path / "tiny"
    save_pretrained(model, hf_dir)
    for path in resolve_tokenizer_dir(None).iterdir():
        shutil.copy(path, hf_dir / path.name)
    server = ThreadingHTTPServer(("127.0.0.1", 0), engine(model))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield hf_dir, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_prompt_logprobs_give_the_in_process_losses(tmp_path, served_tiny):
    hf_dir, url = served_tiny
    rows = [{"id": f"r{i}", "category": "c", "messages": [
        {"role": "user", "content": f"Ticket {i}: the app crashes on start."},
        {"role": "assistant", "content": f'{{"product": "CloudSync", "severity": "high", "n": {i}}}'}]}
        for i in range(3)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "prose.txt").write_text("Rivers run to the sea and the sea does not fill. " * 30)
    (tmp_path / "suite.yaml").write_text(
        "name: lp\nversion: 1\ndecoding: {max_new_tokens: 4, max_tool_rounds: 0}\n"
        "sets:\n  - {name: t, path: rows.jsonl, scorers: [reference_loss]}\n"
        "general_text: {path: prose.txt, max_tokens: 200, window: 64}\n")
    card, _ = run_eval(tmp_path / "suite.yaml", hf_dir, url, tmp_path / "eval", device="cpu", log=lambda _: None)
    metrics = {m["id"]: m for m in card["metrics"]}
    for metric_id in ("t/reference_loss/loss", "general_text/loss/loss"):
        values = metrics[metric_id]["by_category"]["all"]["values"]
        assert "not_available" not in metrics[metric_id]
        assert values["candidate"] == pytest.approx(values["base"], rel=1e-5), metric_id
    assert card["operations"]["candidate"]["endpoint"]["prompt_logprobs"] == "available"
    assert all(e["outputs"]["candidate"]["passed"] for e in card["examples"])
