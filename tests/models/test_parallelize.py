"""parallelize_glm5 on one process: activation checkpointing ("full" or "selective")
changes neither the loss nor the gradients; "selective" keeps the indexer's top-k mask
(and attention, wide matmuls) instead of recomputing it."""

import pytest
import torch

import glmtune.models.glm5.indexer as indexer_module
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.parallelize import parallelize_glm5


def _step(model, x):
    out = model(x, MicroBatch(x, targets=torch.roll(x, -1, 1)))
    (out.loss_sum / out.num_targets).backward()
    return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode,min_k,recomputed_scores", [("selective", 4096, 0), ("selective", 64, 0),
                                                          ("full", 4096, 2)])
def test_checkpointing_modes(monkeypatch, mode, min_k, recomputed_scores):
    args = get_preset("tiny").replace(index_topk=16)
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    scored = []
    original = indexer_module.Indexer.combine
    monkeypatch.setattr(indexer_module.Indexer, "combine",
                        staticmethod(lambda *a: scored.append(1) or original(*a)))
    plain_loss, plain_grads = _step(build_model(args, seed=0), x)
    plain_calls, scored[:] = len(scored), []
    model = parallelize_glm5(build_model(args, seed=0), activation_checkpointing=mode,
                             ac_keep_matmul_min_k=min_k)  # 64: keeps tiny's 128-wide products
    loss, grads = _step(model, x)
    assert plain_calls == args.indexer_types.count("full")  # one chunk per indexer layer
    assert len(scored) == plain_calls + recomputed_scores
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_unknown_checkpointing_mode_is_refused():
    with pytest.raises(ValueError, match="activation_checkpointing='some'"):
        parallelize_glm5(build_model(get_preset("tiny"), seed=0), activation_checkpointing="some")


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, op):
        super().__init__()
        self.op, self.widths = op, []  # the reduction width of each call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.widths.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("min_k", [64, 4096])
def test_selective_checkpointing_keeps_wide_lora_products(min_k):
    """The dense LoRA op (base GEMM + update) is a matmul to the policy: kept when its input
    is at least min_k wide, recomputed below; the gradients are those of the plain model."""
    from glmtune.config.schema import PeftConfig
    from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
    from glmtune.peft import apply_lora

    args = get_preset("tiny").replace(index_topk=16)
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    results = []
    for mode in ("none", "selective"):
        model = build_model(args, seed=0)
        # kv_b_proj (input: the kv latent, narrower than 64) is left out of the default targets since 2026-12-03
        apply_lora(model, PeftConfig(method="lora", rank=4,
                                     target_modules=[*DEFAULT_LORA_TARGETS, "*.self_attn.kv_b_proj"]), seed=0)
        with torch.no_grad():  # B is zero at init: give the update a gradient path that matters
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        model = parallelize_glm5(model, activation_checkpointing=mode, ac_keep_matmul_min_k=min_k)
        with _CountOps(torch.ops.glmtune.lora_linear.default) as counter:
            results.append((*_step(model, x), counter.widths))
    (plain_loss, plain_grads, plain_widths), (loss, grads, widths) = results
    assert any(w >= 64 for w in plain_widths) and any(w < 64 for w in plain_widths)
    # Exactly the products narrower than min_k run again in the backward.
    assert sorted(widths) == sorted(plain_widths + [w for w in plain_widths if w < min_k])
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys() and all(".lora_" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)
