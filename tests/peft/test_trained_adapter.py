"""An adapter reproduces the trained model: a tiny LoRA run on the preset base writes that
base as an HF directory (RUN_DIR/base) and names it in the adapter; transformers + PEFT,
loading nothing but RUN_DIR/base and RUN_DIR/adapter, give the logits of the model the
run trained (its base plus the adapters of its last checkpoint), and so does
`glmtune merge RUN_DIR/base RUN_DIR/adapter OUT` (the recorded base identity matches)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

from glmtune import load_pretrained  # noqa: E402
from glmtune.checkpoint.manager import CheckpointManager  # noqa: E402
from glmtune.cli import main  # noqa: E402
from glmtune.config import load_config  # noqa: E402
from glmtune.models.registry import hf_dir_identity  # noqa: E402
from glmtune.peft import apply_lora  # noqa: E402
from tests.peft.conftest import tokens  # noqa: E402
from tests.train.run_helpers import TWO_STEPS, shared_run  # noqa: E402


def test_peft_on_the_written_base_gives_the_trained_models_logits(tmp_path, shared_results):
    # The two-step LoRA run of tests/train/test_run_e2e.py and the pp 2 test (read only).
    run_dir = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir
    base, adapter = run_dir / "base", run_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    recorded = json.loads((adapter / "glmtune_adapter.json").read_text())["base"]
    assert recorded["weights_sha256"] == hf_dir_identity(base)["weights_sha256"]

    # The trained model: the base plus the adapters of the last checkpoint (step 2).
    cfg = load_config("tiny/lora_support_json")
    trained = load_pretrained(base, dtype=torch.float32, attention_backend="eager", moe_backend="grouped_mm")
    apply_lora(trained, cfg.peft)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad])
    checkpoints = CheckpointManager(run_dir / "checkpoints", trainable_only=True)
    assert checkpoints.latest().step == 2
    checkpoints.load(checkpoints.latest(), trained, optimizer)
    assert any(p.abs().sum() > 0 for n, p in trained.named_parameters() if "_B" in n)  # trained

    hf = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], attn_implementation="eager",
                                              dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = peft.PeftModel.from_pretrained(hf, adapter).eval()
    x = tokens(vocab=trained.args.vocab_size)
    trained.eval()
    with torch.no_grad():
        expected, actual = trained(x).logits, served(x).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    with served.disable_adapter(), torch.no_grad():
        assert (served(x).logits - expected).abs().max() > 1e-3  # the adapter is what makes them equal (0.5)

    assert main(["merge", str(base), str(adapter), str(tmp_path / "merged")]) == 0  # no --force needed
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, expected, rtol=1e-4, atol=1e-4)
