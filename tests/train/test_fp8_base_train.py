"""`glmtune train` with `model.fp8_base: dequant` on an FP8 checkpoint: the LoRA run keeps
the base in e4m3 (said at start), trains, and leaves an adapter that `glmtune merge`
folds into the (dequantized) base, in bf16 or (`--fp8`) re-quantized into the release
format with its error printed; the settings it cannot run with are refused by
`glmtune config validate` naming the key."""

from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load_file

from glmtune import load_pretrained
from glmtune.cli import main
from glmtune.kernels import fp8_blocks
from tests.checkpoint.test_fp8_base_load import shared_fp8_checkpoint
from tests.distributed.test_fp8_base_sharded import RECIPE, _steps
from tests.train.run_helpers import shared_run


def test_lora_on_an_fp8_checkpoint_trains_and_merges(tmp_path, capsys, shared_results):
    base = shared_fp8_checkpoint(shared_results)
    # Three steps on the FP8 base: the one-process run tests/distributed/test_fp8_base_sharded.py compares with.
    done = shared_run(shared_results, *_steps(base), recipe=RECIPE)
    run_dir = done.run_dir
    assert "model: frozen FP8 base" in done.stdout
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any(".experts." in k for k in adapter) and any(t.abs().sum() > 0 for k, t in adapter.items() if "lora_B" in k)
    assert main(["merge", str(base), str(run_dir / "adapter"), str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert merged["model.layers.0.self_attn.q_b_proj.weight"].dtype != torch.float8_e4m3fn  # merged in bf16

    # --fp8: the merged weights re-quantized into the release format, error reported.
    assert main(["merge", str(base), str(run_dir / "adapter"), str(tmp_path / "merged-fp8"), "--fp8"]) == 0
    report = capsys.readouterr().out
    assert re.search(r"re-quantized \d+ merged weights to FP8 .*relative error \S+ overall", report), report
    fp8 = load_file(tmp_path / "merged-fp8" / "model.safetensors")
    config = json.loads((tmp_path / "merged-fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    quantized = [k for k, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in quantized
    for key in quantized:  # each one is the merged weight quantized, scales under the HF name
        q, scale = fp8_blocks.quantize_weight(merged[key].float())
        assert torch.equal(fp8[key].view(torch.uint8), q.view(torch.uint8)), key
        assert torch.equal(fp8[key + "_scale_inv"], scale), key
    assert set(fp8) - set(merged) == {k + "_scale_inv" for k in quantized}
    assert load_pretrained(tmp_path / "merged-fp8", dtype=torch.float32, fp8_base="dequant") is not None


def test_fp8_base_settings_it_cannot_run_are_refused(capsys):
    code = main(["config", "validate", "recipes/tiny/sft_support_json.yaml", "--model.fp8_base", "dequant"])
    out = capsys.readouterr().out
    assert code != 0
    assert "model.fp8_base: dequant needs peft.method: lora" in out
    assert "needs an HF checkpoint directory in model.name_or_path, not the preset 'tiny'" in out
