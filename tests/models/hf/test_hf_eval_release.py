"""An hf-family run evaluated and released as the GLM-5 tiny demo is (Makefile `demo`): a tiny Qwen3
directory (no tokenizer of its own) trained a few steps by `glmtune train` with the bundled tokenizer,
then `glmtune eval` of its base against its result, `glmtune release` of the run with that eval, and
`glmtune release verify`, through the CLI entry points tests/eval and tests/release use.

What it holds: eval decodes the transformers model through the family's cached decoding (it said "no
model family decodes a Qwen3ForCausalLM with a cache"), scores the reference and general-text
losses through the family's spec (it called GLM-5's forward signature), prompts the base with the
tokenizer the run trained with (the Qwen3 directory has none), and reports GLM-5's serving metrics
as not available from this model family; the HF export and the loads print no transformers
progress bar. And a run's `model.family` chooses the family that loads its models in eval (it went by
config.json's model_type alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import AutoModelForCausalLM, Qwen3Config

from glmtune.cli import main
from glmtune.data.synthetic import SCHEMA_PATH
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.eval.models import load_model, resolve_model
from glmtune.models.glm5.spec import GLM5
from glmtune.models.hf.quiet import no_progress_bars
from glmtune.models.hf.spec import HF
from tests.parity.hf_reference import make_hf_model
from tests.train.run_helpers import run_in_fork

GENERAL_TEXT = Path(__file__).resolve().parents[3] / "recipes" / "tiny" / "eval_support_json" / "general_text.txt"
SUITE = {
    "name": "hf-round-trip", "version": "1",
    "decoding": {"max_new_tokens": 8, "batch_size": 8, "max_tool_rounds": 1},
    "sets": [{"name": "tickets", "run_split": "validation", "limit": 3,
              "scorers": [{"type": "task_success", "fields": ["product", "severity", "next_action"]},
                          {"type": "format", "schema": str(SCHEMA_PATH)}, "reference_loss"]}],
    "general_text": {"path": str(GENERAL_TEXT), "max_tokens": 128, "window": 64},
    "gates": [{"name": "reference loss improves", "metric": "tickets/reference_loss/loss", "rule": "improves"},
              {"name": "p95 latency", "metric": "operations/latency/p95_s", "rule": "max", "threshold": 60}],
}
PROGRESS_BARS = ("Writing model shards", "Loading weights")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/eval: the tiny model's small ops run faster on one thread per worker
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    """(the tiny Qwen3 directory, the run directory of 4 SFT steps on it, what the run printed)."""
    root = tmp_path_factory.mktemp("hf_round_trip")
    config = Qwen3Config(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with no_progress_bars():  # transformers' own bar, not the one this test looks for
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "qwen3")
    done = run_in_fork(root / "run", root / "cache", "--model.name_or_path", str(root / "qwen3"), "--data.tokenizer",
                       str(TINY_TOKENIZER_DIR), "--train.max_steps", "4", "--optim.warmup_steps", "1",
                       "--checkpoint.every_steps", "4", "--checkpoint.export_hf", "true")
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "qwen3", root / "run", done.stdout + done.stderr


def _main(argv: list[str]) -> tuple[int, str]:
    """`glmtune ARGV` in this process: (exit status, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def test_a_qwen3_run_evaluates_and_releases_like_the_glm5_demo(qwen3_run, tmp_path):
    qwen3_dir, run_dir, trained = qwen3_run
    assert (run_dir / "hf" / "config.json").is_file() and not any(bar in trained for bar in PROGRESS_BARS)
    suite, eval_dir = tmp_path / "suite.yaml", run_dir / "eval" / "hf-round-trip"
    suite.write_text(yaml.safe_dump(SUITE, sort_keys=False))

    code, printed = _main(["eval", str(suite), "--base", str(run_dir), "--candidate", str(run_dir), "--device", "cpu"])
    assert code == 0, printed
    assert not any(bar in printed for bar in PROGRESS_BARS), printed
    card = json.loads((eval_dir / "scorecard.json").read_text())
    assert card["passed"] and all(g["passed"] for g in card["gates"])
    assert [(m["label"], m["fingerprint"]["path"]) for m in card["models"]] == [
        ("base", str(qwen3_dir)), ("candidate", str(run_dir / "hf"))]
    metrics = {m["id"]: m for m in card["metrics"]}
    loss = metrics["tickets/reference_loss/loss"]["by_category"]["all"]["values"]
    assert loss["base"] > 8 and loss["candidate"] < loss["base"] - 0.1  # random init: ~ln(4096) = 8.3
    text = metrics["general_text/loss/loss"]["by_category"]["all"]
    assert text["n"] > 100 and all(7 < v < 9 for v in text["values"].values())
    answers = [e["outputs"]["candidate"] for e in card["examples"]]
    assert len(answers) == 3 and all(a["error"] is None and a["text"] for a in answers)
    for name in ("mtp_acceptance", "indexer_recall"):
        why = metrics[f"operations/serving/{name}"]["not_available"]
        assert set(why) == {"base", "candidate"} and all(w.startswith("not available from this model family: hf")
                                                         for w in why.values())

    engine = f"transformers=={transformers.__version__}"
    code, printed = _main(["release", str(run_dir), "--eval", str(eval_dir), "--engine", engine])
    assert code == 0, printed
    manifest = json.loads((run_dir / "release.json").read_text())
    assert manifest["run"]["shipped"] == ["checkpoint"] and manifest["eval"]["passed"]
    assert manifest["base"]["path"] == str(qwen3_dir) and manifest["tokenizer"]["path"] == "hf"
    scorecard_sha256 = hashlib.sha256((eval_dir / "scorecard.json").read_bytes()).hexdigest()
    assert manifest["eval"]["scorecard_sha256"] == scorecard_sha256
    code, printed = _main(["release", "verify", str(run_dir / "release.json"), "--allow-outside"])
    assert code == 0, printed


def test_a_runs_model_family_chooses_the_family_that_evaluates_it(qwen3_run, tmp_path):
    """`model.family: hf` on a GLM-5 directory: eval loads the run's base as transformers' GLM-5 (the
    family the run trained), not glmtune's native one, which config.json's model_type alone names."""
    _, trained_run, _ = qwen3_run
    with no_progress_bars():
        make_hf_model("glm5").save_pretrained(tmp_path / "glm5")
    config = yaml.safe_load((trained_run / "config.yaml").read_text())
    config["model"].update(name_or_path=str(tmp_path / "glm5"), family="hf")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    base = resolve_model(tmp_path / "run", "base")
    assert (base.weights_dir, base.family, base.spec) == (tmp_path / "glm5", "hf", HF)
    assert type(load_model(base, torch.device("cpu"), None)).__name__ == "GlmMoeDsaForCausalLM"
    assert resolve_model(tmp_path / "glm5", "base").spec is GLM5  # a directory alone: by its model_type
