"""The pipeline split: balanced by training cost (exact optimum), stage placement per schedule, and
stages that, chained in one process, compute the model's own loss and gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from glmtune.distributed.pipeline_plan import balanced_split, plan_stages, stage_ids_for_rank
from glmtune.models.common.microbatch import MicroBatch, StageMicrobatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.counts import parameter_report
from glmtune.models.glm5.stage_costs import head_cost, layer_costs
from glmtune.models.glm5.stages import decoder_layers, split_into_stages


def _brute_force(costs, stages, extra):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) + (extra if b == len(costs) else 0) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_balanced_split_is_the_best_contiguous_split(seed):
    generator = torch.Generator().manual_seed(seed)
    costs = (torch.rand(9, generator=generator) * 10).tolist()
    for stages in (2, 3, 4):
        split = balanced_split(costs, stages, last_extra=4.0)
        assert len(split) == stages and sum(split) == 9 and min(split) >= 1
        bounds = [0, *itertools.accumulate(split)]
        worst = max(sum(costs[a:b]) + (4.0 if b == 9 else 0) for a, b in zip(bounds, bounds[1:]))
        assert worst == pytest.approx(_brute_force(costs, stages, 4.0))


def test_costs_follow_the_model_dense_moe_indexer_and_head():
    args = get_preset("glm5.3")
    costs = layer_costs(args, 4096)
    # The matmul part is 6 x the layer's active parameters (counted on the real module tree).
    rows = parameter_report(args)["layers"]
    attention = 3 * 2 * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * 2048 * (
        (2048 * 2049 / 2 + (4096 - 2048) * 2048) / 4096) / 2048
    for row, cost, index in zip(rows, costs, args.indexer_types):
        if index == "shared":
            norms = 2 * args.hidden_size + args.q_lora_rank + args.kv_lora_rank  # not matmuls
            assert cost - attention == pytest.approx(6 * (row["active_params"] - norms), rel=1e-6)
    assert costs[0] < costs[3]  # a dense layer costs less than a MoE layer
    full = [c for c, t in zip(costs[3:], args.indexer_types[3:]) if t == "full"]
    shared = [c for c, t in zip(costs[3:], args.indexer_types[3:]) if t == "shared"]
    assert min(full) > max(shared)  # the indexer scores every earlier key
    glm5 = get_preset("glm5")
    assert plan_stages(layer_costs(glm5, 4096), head_cost(glm5), 4) == [20, 20, 20, 18]  # the head weighs on the last stage
    assert head_cost(args) > costs[3]
    assert plan_stages(costs, head_cost(args), 4, explicit=[10, 30, 30, 8]) == [10, 30, 30, 8]


def test_stage_placement_per_schedule():
    assert [stage_ids_for_rank("1F1B", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert stage_ids_for_rank("Interleaved1F1B", 1, 4, 3) == [1, 5, 9]
    assert [stage_ids_for_rank("ZBVZeroBubble", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]


def test_chained_stages_compute_the_model_loss_and_gradients():
    """Split 1/3 (stage 1 starts on a shared-indexer layer: the selection is carried), in one process."""
    args = get_preset("tiny")
    reference = build_model(args, torch.float32, seed=0)
    model = build_model(args, torch.float32, seed=0)
    seq = 320  # above the top-k (256): the sparse selection runs and is carried
    ids = torch.randint(0, 4000, (2, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.arange(seq), torch.cat([torch.arange(300), torch.arange(20)])])
    documents = torch.stack([torch.zeros(seq, dtype=torch.long), (torch.arange(seq) >= 300).long()])
    targets = torch.roll(ids, -1, 1)
    out = reference(ids, MicroBatch(ids, positions, documents, targets), compute_logits=False)
    out.loss_sum.backward()

    first, second = split_into_stages(model, [1, 3], [0, 1])
    assert not first.carry_in and first.carry_out and second.carry_in
    assert [layer.layer_idx for layer in decoder_layers(model)] == [0, 1, 2, 3]
    mb = MicroBatch(ids, positions, documents, targets).rows(slice(None))  # with its host facts
    first.microbatches, second.microbatches = [StageMicrobatch(mb)], [StageMicrobatch(mb)]
    carried = first(ids)
    assert [t.dtype for t in carried] == [torch.float32, torch.uint8, torch.uint8]
    loss = second(*carried)
    torch.testing.assert_close(loss, out.loss_sum.reshape(1), rtol=1e-6, atol=0)
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_pruned_model_keeps_the_full_model_names():
    args = get_preset("tiny")
    full = set(build_model(args, torch.float32, device="meta").state_dict())
    parts = []
    for stage_ids in ([0, 2], [1, 3]):  # interleaved: 4 stages of one layer on 2 ranks
        model = build_model(args, torch.float32, device="meta")
        split_into_stages(model, [1, 1, 1, 1], stage_ids)
        parts.append(set(model.state_dict()))
    assert parts[0] | parts[1] == full and not parts[0] & parts[1]
    assert "model.embed_tokens.weight" in parts[0] and "lm_head.weight" in parts[1]
    assert any(k.startswith("mtp.") for k in parts[1]) and not any(k.startswith("mtp.") for k in parts[0])


def test_stages_start_only_where_allowed_and_stay_balanced_among_those_splits():
    costs = [1.0] * 12
    assert balanced_split(costs, 3) == [4, 4, 4]
    allowed = frozenset({0, 4, 5, 9})  # e.g. the layers running their own indexer
    assert balanced_split(costs, 3, starts=allowed) == [4, 5, 3]  # costliest stage 5; [4, 1, 7] would be 7
    with pytest.raises(ValueError, match="only 2 layers may start a pipeline stage"):
        balanced_split(costs, 4, starts=frozenset({0, 5}))
