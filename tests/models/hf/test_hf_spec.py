"""`HF` (the hf family's spec) against transformers' own model on tiny Llama, Qwen3, Qwen3-MoE and GLM-4 checkpoints:
the same logits, the same loss and gradients (and AdamW step), packed documents kept apart, an
export transformers loads back.

Tolerances: the spec's model *is* transformers' class with the same weights, so logits and a
save/load round trip are compared exactly. The loss runs glmtune's chunked fused cross-entropy on
the final hidden states instead of transformers' full logits and `F.cross_entropy`, so loss and
gradients agree to fp32 rounding (rtol 1e-5); a packed row runs SDPA with a block mask instead of
two causal calls, again fp32 rounding (atol 1e-5, against differences of order 1 without the mask).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.hf.spec import HF

from .conftest import packed_batch


def reference(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def reference_loss(model, batch) -> torch.Tensor:
    """A plain transformers forward and summed cross-entropy over the supervised targets."""
    logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100, reduction="sum")


def grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_load_equals_transformers_logits(tiny_dir):
    ids = packed_batch([12])["input_ids"]
    ours, theirs = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu"), reference(tiny_dir)
    assert torch.equal(ours(ids).logits, theirs(ids).logits)
    meta = HF.weights.build(HF.architecture.args_from_hf(tiny_dir), device="meta")
    assert type(meta) is type(theirs) and meta.get_output_embeddings().weight.is_meta


def test_build_from_args_is_transformers_class(tiny_dir):
    args = HF.architecture.args_from_hf(tiny_dir)
    model = HF.weights.build(args, seed=0)
    assert {k: v.shape for k, v in model.state_dict().items()} == \
        {k: v.shape for k, v in reference(tiny_dir).state_dict().items()}
    assert HF.architecture.args_of(model) == args


def test_training_step_equals_transformers(tiny_dir):
    batch = packed_batch([16], seed=1)
    ours, theirs = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu"), reference(tiny_dir)
    loss, count = HF.compute.loss(ours, MicroBatch(**batch))
    expected = reference_loss(theirs, batch)
    assert int(count) == 15
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    (loss / count).backward()
    (expected / count).backward()
    ours_grads, theirs_grads = grads(ours), grads(theirs)
    assert ours_grads.keys() == theirs_grads.keys() and len(ours_grads) > 5
    for name in ours_grads:
        torch.testing.assert_close(ours_grads[name], theirs_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    # The gradients agree to ~1e-7 absolute (fp32 rounding of sums of O(0.3) terms, above). AdamW's
    # first step is lr * g / (|g| + eps) per element, so a gradient difference d moves a weight by up
    # to lr * d / eps: with the default eps=1e-8 an element whose gradient is itself ~1e-7 (a key
    # bias's is 0 in exact arithmetic: softmax is shift-invariant) differs by up to lr. eps=1e-4
    # bounds that by 1e-6, while gradients of real size (>= 1e-3) still take Adam's normalized step.
    for model in (ours, theirs):
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4).step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6, msg=name)


def test_packed_documents_equal_separate_runs(tiny_dir):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    packed, first, second = packed_batch([9, 7], seed=2), packed_batch([9], seed=2), None
    second = {key: value[:, 9:] for key, value in packed.items()}
    second["document_ids"] = second["document_ids"] - 1
    loss, count = HF.compute.loss(model, MicroBatch(**packed))
    loss.backward()
    packed_grads = grads(model)
    model.zero_grad()
    separate = [HF.compute.loss(model, MicroBatch(**batch)) for batch in (first, second)]
    sum(loss for loss, _ in separate).backward()
    assert int(count) == 14 == sum(int(n) for _, n in separate)
    torch.testing.assert_close(loss, sum(loss for loss, _ in separate), rtol=1e-5, atol=1e-5)
    for name, grad in grads(model).items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    logps = HF.compute.token_logps(model, MicroBatch(**packed))
    apart = torch.cat([HF.compute.token_logps(model, MicroBatch(**batch)) for batch in (first, second)], dim=1)
    torch.testing.assert_close(logps, apart, rtol=1e-5, atol=1e-5)
    # Positions running on across the boundary: only the document ids tell the documents apart
    # (RoPE is relative, so the second document still equals its separate run); without them the
    # second document attends the first.
    running = {**packed, "position_ids": torch.arange(16)[None]}
    torch.testing.assert_close(HF.compute.token_logps(model, MicroBatch(**running)), apart, rtol=1e-5, atol=1e-5)
    leaked = HF.compute.token_logps(model, MicroBatch(**{**running, "document_ids": None}))
    assert (leaked - apart)[:, 9:].abs().max() > 1e-2


def test_save_pretrained_loads_in_transformers(tiny_dir, tmp_path):
    model = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    with torch.no_grad():  # a trained model: not the weights it was loaded with
        for param in model.parameters():
            param.add_(0.01)
    out = HF.weights.save_pretrained(model, tmp_path / "export", source_dir=tiny_dir)
    ids = packed_batch([10])["input_ids"]
    assert torch.equal(reference(out)(ids).logits, model(ids).logits)
    assert (out / "generation_config.json").is_file()
    bf16 = HF.weights.save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True)
    assert loaded.get_input_embeddings().weight.dtype == torch.bfloat16


def test_activation_checkpointing_keeps_loss_and_gradients(tiny_dir):
    from glmtune.config.schema import ParallelConfig

    batch = packed_batch([6, 10], seed=3)
    plain = HF.weights.load_pretrained(tiny_dir, torch.float32, "cpu")
    checkpointed = copy.deepcopy(plain)
    HF.compute.parallelize(checkpointed, None, ParallelConfig(activation_checkpointing="full"))
    results = []
    for model in (plain, checkpointed):
        model.train()
        loss, _ = HF.compute.loss(model, MicroBatch(**batch))
        loss.backward()
        results.append((loss.detach(), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-6, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="selective.*not available for the hf family"):
        HF.compute.parallelize(plain, None, ParallelConfig(activation_checkpointing="selective"))


def test_weights_not_the_configs_are_refused(tiny_dir, tmp_path):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(tiny_dir / "model.safetensors")
    layer_types = {"layer_types": config["layer_types"][:1]} if "layer_types" in config else {}
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, **layer_types}))
    with pytest.raises(ValueError, match="is of layer 1.*num_hidden_layers=1"):
        HF.architecture.args_from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 128}))
    with pytest.raises(ValueError, match="embed_tokens.weight has shape"):
        HF.architecture.args_from_hf(tmp_path)
