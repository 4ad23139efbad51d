"""Context parallelism on gloo: cp ranks, each computing its share of the queries of the same
rows, add up to one process exactly.

The tiny model (GLM-5.2-shaped: shared-indexer layers, MoE) in fp32 with its top-256
indexer on rows of 512 (one case 640) tokens, so the sparse selection is active; micro batch 2. For each
case the per-rank loss sums and target counts add up to the one-process ones, every
parameter's gradient summed over the ranks is the one-process gradient, and each full
indexer layer selects, for this rank's queries, exactly the keys it selects in one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from glmtune.distributed.context_parallel import apply_context_parallel, gather_sequence
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.gloo_helpers import run_gloo

SEQ = 512
# Documents per row; "packed" rows have documents longer than the top-k (256) that cross
# the cp slice boundaries (128, 256, 384 at cp 2 / 4).
ROWS = {
    "packed": [[300, 212], [40, 280, 192]],
    "one_document": [[SEQ], [SEQ]],
    "mixed": [[SEQ], [100, 412]],  # a one-document row next to a packed one: no plain-causal path
    # 320 queries a contiguous cp-2 slice: the first rank's piece runs is_causal for its first
    # 256 queries and the top-k mask for the rest
    "one_document_640": [[640], [640]],
}


def _batch(rows: str):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4000, (2, sum(ROWS[rows][0])), generator=generator)
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    targets[0, :17] = -100  # unsupervised prompt tokens: counts differ between ranks
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS[rows]])
    return ids, targets, positions


def _model(backend: str):
    return build_model(get_preset("tiny"), torch.float32, attention_backend=backend, seed=0)


def _record_selections(model) -> list[torch.Tensor]:
    masks = []
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: masks.append(out[0]))
    return masks


def _forward_backward(model, rows: str):
    ids, targets, positions = _batch(rows)
    masks = _record_selections(model)
    out = model(ids, MicroBatch(ids, positions, targets=targets), compute_logits=False)
    out.loss_sum.backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    return out.loss_sum.detach(), int(out.num_targets), grads, masks


def _stage_by_stage_loss(model, rows: str) -> torch.Tensor:
    """What pipeline stages compute: embed the local tokens, layers [0, 1) then [1, 4) (layer 1
    shares layer 0's selection, carried across), final norm and the loss of the local targets."""
    from glmtune.models.common.loss import chunked_cross_entropy

    ids, targets, positions = _batch(rows)
    core = model.model
    h_BSD = core.embed_tokens(core.local_tokens(ids))
    inputs = core.layer_inputs(ids.shape[0], ids.shape[1], h_BSD.device, h_BSD.dtype, positions)
    h_BSD, selection = core.run_layers(list(core.layers)[:1], h_BSD, inputs)
    h_BSD, _ = core.run_layers(list(core.layers)[1:], h_BSD, inputs, selection)
    loss_sum, _ = chunked_cross_entropy(core.norm(h_BSD), model.lm_head.weight, core.local_tokens(targets))
    return loss_sum.detach()


def _cp_worker(rank: int, world_size: int, out_dir: str, backend: str, balance: str, rows: str,
               stages: bool) -> None:
    model = _model(backend)
    apply_context_parallel(model, dist.group.WORLD, balance)
    shard = model.model.sequence_shard
    loss, count, grads, masks = _forward_backward(model, rows)
    result = {"loss": loss, "count": count, "grads": grads, "masks": list(masks),
              "query_index": shard.query_index(sum(ROWS[rows][0]))}
    if stages:
        ids, targets, positions = _batch(rows)
        with torch.no_grad():
            result["stage_loss"] = _stage_by_stage_loss(model, rows)
            result["forward_loss"] = model(ids, MicroBatch(ids, positions, targets=targets),
                                           compute_logits=False).loss_sum
    torch.save(result, f"{out_dir}/rank{rank}.pt")


CASES = [  # backend, balance, cp, rows
    ("sdpa", "head_tail", 2, "packed"),
    ("sdpa", "contiguous", 2, "packed"),
    ("sdpa", "head_tail", 2, "one_document"),
    ("gemm", "contiguous", 2, "one_document_640"),
    ("gemm", "head_tail", 2, "mixed"),
    ("eager", "head_tail", 2, "packed"),
    ("sdpa", "head_tail", 4, "packed"),
]


@functools.cache
def _one_process(backend: str, rows: str):
    """The one-process model and its loss sum, target count, gradients and selections (cases
    that differ only in balance or cp compare against the same one)."""
    reference = _model(backend)
    return reference, *_forward_backward(reference, rows)


@pytest.mark.parametrize("backend,balance,cp,rows", CASES)
def test_cp_ranks_add_up_to_one_process(tmp_path, backend, balance, cp, rows):
    reference, ref_loss, ref_count, ref_grads, ref_masks = _one_process(backend, rows)
    stages = (backend, balance, cp, rows) == CASES[0]
    run_gloo(_cp_worker, cp, tmp_path, str(tmp_path), backend, balance, rows, stages)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(cp)]

    loss = sum(r["loss"] for r in results)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert sum(r["count"] for r in results) == ref_count
    assert len({r["count"] for r in results}) > 1  # each rank counts its own targets (17 unsupervised on rank 0)

    for name, ref_grad in ref_grads.items():
        grad = sum(r["grads"][name] for r in results)
        rel = (grad - ref_grad).norm() / ref_grad.norm().clamp_min(1e-12)
        assert rel.item() <= 1e-5, (name, rel.item())
    assert all(set(r["grads"]) == set(ref_grads) for r in results)

    # the sparse path ran: each full indexer layer (0 and 2) dropped allowed keys
    seq = sum(ROWS[rows][0])
    allowed = reference.model.layer_inputs(2, seq, torch.device("cpu"), torch.float32, _batch(rows)[2]).allowed_BST
    assert len(ref_masks) == 2 and all(mask.sum() < allowed.sum() for mask in ref_masks)
    for r in results:
        for ref_mask, mask in zip(ref_masks, r["masks"], strict=True):
            assert mask.shape == (2, seq // cp, seq)
            assert torch.equal(mask, ref_mask[:, r["query_index"]])

    if stages:
        for r in results:
            assert torch.equal(r["stage_loss"], r["forward_loss"])


def _gather_worker(rank: int, world_size: int, out_dir: str) -> None:
    group = dist.group.WORLD
    full_BTX = torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(0))
    weights_BTX = torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(rank + 1))
    grads = {}
    for balance in ("head_tail", "contiguous"):
        shard = SequenceShard(rank, world_size, balance, gather=lambda x: gather_sequence(x, group, balance))
        local_BSX = shard.local(full_BTX).clone().requires_grad_()
        gathered = shard.gather(local_BSX)
        assert torch.equal(gathered, full_BTX), balance
        (gathered * weights_BTX).sum().backward()  # each rank its own upstream gradient
        grads[balance] = local_BSX.grad
    model = _model("sdpa")
    apply_context_parallel(model, group, "contiguous")
    try:
        apply_context_parallel(model, group)
        raise AssertionError("applied twice")
    except ValueError as error:
        assert "already context-parallel" in str(error)
    torch.save(grads, f"{out_dir}/rank{rank}.pt")


def test_gather_sequence_is_row_order_and_its_gradient_the_summed_slice(tmp_path):
    """cp 3 (head_tail: the last rank holds chunks 2 and 3, one piece): the gather returns the full rows in
    row order; its gradient on each rank is that rank's slice of the sum over ranks."""
    world_size = 3
    run_gloo(_gather_worker, world_size, tmp_path, str(tmp_path))
    summed = sum(torch.randn(2, 48, 5, generator=torch.Generator().manual_seed(r + 1)) for r in range(world_size))
    for rank in range(world_size):
        grads = torch.load(tmp_path / f"rank{rank}.pt")
        for balance, grad in grads.items():
            shard = SequenceShard(rank, world_size, balance, gather=lambda x: x)
            torch.testing.assert_close(grad, shard.local(summed), rtol=0, atol=1e-6)
