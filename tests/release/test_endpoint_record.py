"""`glmtune release` of a scorecard with an endpoint model (`glmtune eval --base http://HOST:PORT/v1`):
the manifest records the endpoint, the served model id and what the engine said of its version,
with the endpoint's request accounting; an endpoint candidate is refused (no weights to check)."""

from __future__ import annotations

import json

from glmtune.cli import main

ENDPOINT = {"endpoint": "http://127.0.0.1:8000/v1", "model": "zai-org/GLM-5", "api": "completions",
            "engine_server": "uvicorn", "engine_owned_by": "vllm", "engine_version": "0.11.0"}
ACCOUNTING = {"api": "completions", "model": "zai-org/GLM-5", "concurrency": 8, "timeout_s": 120.0, "max_retries": 3,
              "http_requests": 5, "retries": 1, "failed_requests": 0, "failures": {}, "faults": {"http 429": 1},
              "prompt_token_mismatches": 0, "unparsed_tool_markup": 0, "prompt_logprobs": "available"}


def _served(eval_dir, label: str) -> None:
    """The scorecard's `label` model as `glmtune eval` records an endpoint model."""
    path = eval_dir / "scorecard.json"
    card = json.loads(path.read_text())
    model = next(m for m in card["models"] if m["label"] == label)
    model.update(source=ENDPOINT["endpoint"], kind="endpoint", fingerprint=dict(ENDPOINT), merged=None)
    card["operations"][label].update(device=ENDPOINT["endpoint"], peak_memory_gib=None, endpoint=ACCOUNTING,
                                     peak_memory_note="not measured: the model runs in the engine's process")
    path.write_text(json.dumps(card, indent=2) + "\n")


def test_release_records_an_endpoint_base(sft_run, capsys):
    run, eval_dir = sft_run
    _served(eval_dir, "base")
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 0, capsys.readouterr()
    m = json.loads((run / "release.json").read_text())
    base = next(entry for entry in m["eval"]["models"] if entry["label"] == "base")
    assert base["kind"] == "endpoint" and base["source"] == ENDPOINT["endpoint"] and base["fingerprint"] == ENDPOINT
    assert m["eval"]["operations"]["base"]["endpoint"] == ACCOUNTING
    assert "endpoint" not in m["eval"]["operations"]["candidate"]


def test_release_refuses_an_endpoint_candidate(sft_run, capsys):
    run, eval_dir = sft_run
    _served(eval_dir, "candidate")
    assert main(["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]) == 2
    assert ("'candidate' is the endpoint http://127.0.0.1:8000/v1 (served model 'zai-org/GLM-5'): its weights cannot "
            "be checked against the run's") in capsys.readouterr().err
