"""An FP8 checkpoint loaded as a frozen FP8 base (`load_pretrained(..., fp8_base=...)`):
the e4m3 weights and block scales land in the model as the file holds them (the routed
experts' gate and up stacked), the model computes what the dequantized checkpoint
computes, and a LoRA adapter trained on it and exported applies, through transformers +
PEFT, to the dequantized base with the trained model's logits."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import load_pretrained, save_pretrained
from glmtune.config.schema import PeftConfig
from glmtune.kernels import fp8_blocks
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model
from glmtune.peft import apply_lora, export_adapter
from tests.checkpoint.test_hf_io import _quantize_blockwise

peft = pytest.importorskip("peft")

# Several 128-blocks and a partial one (q_lora_rank 192); expert width 128, so gate and up
# fill whole blocks of the stacked [2I, D] weight.
ARGS = dict(hidden_size=256, q_lora_rank=192, moe_intermediate_size=128)


def _fp8_checkpoint(path):
    save_pretrained(build_model(get_preset("tiny").replace(**ARGS), seed=1), path)
    tensors = load_file(path / "model.safetensors")
    for key in list(tensors):
        if tensors[key].dim() == 2 and key.endswith(("proj.weight", "proj_with_mqa.weight")) \
                and "weights_proj" not in key:
            tensors[key], tensors[key + "_scale_inv"], _ = _quantize_blockwise(tensors[key])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, tensors


def shared_fp8_checkpoint(shared_results):
    """`_fp8_checkpoint`, written once per session for the runs that train LoRA on it (read only)."""
    return shared_results.get("fp8-checkpoint", lambda root: _fp8_checkpoint(root / "fp8")) / "fp8"


def _tokens(vocab, seed=0):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_fp8_checkpoint_loads_raw_and_computes_the_dequantized_model(tmp_path):
    path, tensors = _fp8_checkpoint(tmp_path / "fp8")
    model = load_pretrained(path, dtype=torch.float32, attention_backend="eager", fp8_base="dequant")
    state = model.state_dict()
    key = "model.layers.0.self_attn.q_b_proj.weight"
    assert state[key].dtype == torch.float8_e4m3fn
    assert torch.equal(state[key].view(torch.uint8), tensors[key].view(torch.uint8))
    assert torch.equal(state[key + "_scale_inv"], tensors[key + "_scale_inv"])
    up = "model.layers.2.mlp.experts.3.up_proj.weight"
    stacked = state["model.layers.2.mlp.experts.gate_up_proj"][3, 128:]
    assert torch.equal(stacked.view(torch.uint8), tensors[up].view(torch.uint8))
    assert torch.equal(state["model.layers.2.mlp.experts.gate_up_proj_scale_inv"][3, 1:], tensors[up + "_scale_inv"])
    assert state["model.embed_tokens.weight"].dtype == torch.float32  # not quantized

    dequantized = load_pretrained(path, dtype=torch.float32, attention_backend="eager")
    x = _tokens(model.args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, dequantized(x).logits, rtol=1e-5, atol=1e-5)


def test_bf16_checkpoint_onto_an_fp8_base_is_quantized_on_load(tmp_path):
    path = save_pretrained(build_model(get_preset("tiny").replace(**ARGS), seed=1), tmp_path / "bf16")
    model = load_pretrained(path, dtype=torch.float32, fp8_base="dequant")
    weight = load_file(path / "model.safetensors")["model.layers.1.self_attn.o_proj.weight"]
    q, scale = fp8_blocks.quantize_weight(weight)
    state = model.state_dict()
    assert torch.equal(state["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(state["model.layers.1.self_attn.o_proj.weight_scale_inv"], scale)


def test_expert_width_off_the_block_grid_is_refused(tmp_path):
    path = save_pretrained(build_model(get_preset("tiny"), seed=1), tmp_path / "tiny")  # expert width 64
    with pytest.raises(ValueError, match="moe_intermediate_size 64 is not a multiple of 128"):
        load_pretrained(path, dtype=torch.float32, fp8_base="dequant")


def test_adapter_trained_on_the_fp8_base_applies_to_the_dequantized_base(tmp_path):
    from transformers import AutoModelForCausalLM

    path, _ = _fp8_checkpoint(tmp_path / "fp8")
    trained = load_pretrained(path, dtype=torch.float32, attention_backend="eager", fp8_base="dequant")
    apply_lora(trained, PeftConfig(method="lora", rank=4), seed=0)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        x = _tokens(trained.args.vocab_size, seed=step + 1)
        out = trained(x, MicroBatch(x, targets=torch.roll(x, -1, 1)))
        (out.loss_sum / out.num_targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    deq_dir = save_pretrained(load_pretrained(path, dtype=torch.float32), tmp_path / "dequantized")
    adapter_dir = export_adapter(trained, tmp_path / "adapter", "peft", str(deq_dir))

    hf = AutoModelForCausalLM.from_pretrained(deq_dir, attn_implementation="eager", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
    trained.eval()
    x = _tokens(trained.args.vocab_size, seed=9)
    with torch.no_grad():
        expected = trained(x).logits
        torch.testing.assert_close(served(x).logits, expected, rtol=1e-4, atol=1e-4)
        with served.disable_adapter():
            assert (served(x).logits - expected).abs().max() > 1e-3  # the adapter is what makes them equal
