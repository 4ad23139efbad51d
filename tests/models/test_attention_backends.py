"""The SDPA and GEMM backends (causal prefix + key-trimmed masked blocks) against the eager reference:
logits and gradients, for one-document and packed rows, with top-k sparsity active."""

import pytest
import torch

from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model


def assert_backend_matches_eager(backend: str, packed: bool, configure=None) -> None:
    """Tiny model, 2 rows of 40 tokens, top-12 active: logits and every gradient of `backend`
    (its model first passed to `configure`, if given) against "eager" (also run by
    tests/kernels/test_sparse_attention.py for "triton")."""
    args = get_preset("tiny").replace(index_topk=12)
    eager = build_model(args, attention_backend="eager", seed=0)
    fast = build_model(args, attention_backend=backend, seed=0)
    if configure is not None:
        configure(fast)
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(x, -1, 1)
    positions = torch.cat([torch.arange(25), torch.arange(15)]).unsqueeze(0) if packed else None
    outs = []
    for model in (eager, fast):
        out = model(x, MicroBatch(x, positions, targets=targets))
        (out.loss_sum / out.num_targets).backward()
        outs.append(out.logits.detach())
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
    fast_params = dict(fast.named_parameters())
    for name, param in eager.named_parameters():
        if param.grad is None:
            continue
        rel = (fast_params[name].grad - param.grad).norm() / param.grad.norm().clamp_min(1e-12)
        assert rel.item() <= 1e-4, name


@pytest.mark.parametrize("backend", ["sdpa", "gemm"])
@pytest.mark.parametrize("packed", [False, True])
def test_blocked_backends_match_eager_reference(packed, backend):
    def seven_query_blocks(model):
        for layer in model.model.layers:
            layer.self_attn.query_block = 7

    assert_backend_matches_eager(backend, packed, seven_query_blocks)


@pytest.mark.parametrize("packed", [False, True])
def test_flex_backend_forward_matches_eager_reference(packed):
    """FlexAttention's block-sparse path (forward: it has no CPU backward; training is
    checked on GPU by benchmarks/throughput.py against transformers). 160 tokens so the
    mask spans two 128-wide tiles: skipped, partial and (in the prefix) full tiles."""
    args = get_preset("tiny").replace(index_topk=48)
    eager = build_model(args, attention_backend="eager", seed=0)
    fast = build_model(args, attention_backend="flex", seed=0)
    x = torch.randint(0, 4000, (2, 160), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(100), torch.arange(60)]).unsqueeze(0) if packed else None
    with torch.no_grad():
        reference = eager(x, MicroBatch(x, positions)).logits
        got = fast(x, MicroBatch(x, positions)).logits
    assert (reference - got).abs().max().item() <= 1e-4
