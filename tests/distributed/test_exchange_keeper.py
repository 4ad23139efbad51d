"""`parallel.ep_keep_exchanges` on CPU (glmtune/distributed/exchange_keeper.py): under full activation
checkpointing the recomputation takes the expert all-to-alls' received rows from the forward.

Two gloo ranks train the tiny GLM-5 (ep 2, all-to-all dispatcher, two chunks) one step with each
choice. The loss and every gradient equal the plain recomputation's bit for bit; the rows' exchanges
the ranks issue fall from 12 per MoE layer (forward, recomputation and backward: each chunk's
dispatch and combine) to 10 with "combine" or "dispatch" and 8 with "both" (keeping the dispatch
also skips the recomputation's count exchange and its host sync, which "counts" alone skips too, the rows
exchanged again); nothing kept outlives the step; a forward without gradients keeps nothing. The settings
it needs are refused in one sentence, the plan counts the rows, and a recomputation that routes otherwise
than its forward is refused."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from glmtune.config import load_config
from glmtune.config.schema import ParallelConfig
from glmtune.config.validate import check_ranges
from glmtune.distributed import token_exchange
from glmtune.distributed.exchange_keeper import KEPT_EXCHANGES, Keeper, keeping
from glmtune.distributed.loopback import join_loopback_world
from glmtune.distributed.mesh import ParallelMesh
from glmtune.distributed.token_exchange import AllToAllTokenDispatcher
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.parallelize import parallelize_glm5
from glmtune.plan.measure import planned_for
from glmtune.plan.planner import degrees_for
from tests.distributed.gloo_helpers import run_gloo

CHOICES = ("none", "counts", "combine", "dispatch", "both")


def _counted(calls: dict, key: str, fn):
    def call(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return fn(*args, **kwargs)
    return call


def _step(model, rank: int, grad: bool = True) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, 4000, (1, 9 + 8 * rank), generator=generator)
    with torch.set_grad_enabled(grad):
        loss = model(ids, MicroBatch(ids, targets=ids.roll(-1, 1))).loss_sum
    if not grad:
        return {"loss": loss.detach()}
    loss.backward()
    grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}


def _kept_rows_alive() -> int:
    gc.collect()
    return sum(len(items) for keeper in gc.get_objects() if isinstance(keeper, Keeper)
               for items in keeper.items.values())


def _worker(rank: int, world: int, out_dir) -> None:
    calls: dict[str, int] = {}
    token_exchange._Transfer.issue = _counted(calls, "rows", token_exchange._Transfer.issue)
    token_exchange.all_to_all_single = _counted(calls, "counts", token_exchange.all_to_all_single)
    mesh = ParallelMesh.from_config(ParallelConfig(ep=world), world_size=world)
    results = {}
    for keep in CHOICES:
        model = parallelize_glm5(build_model(get_preset("tiny"), seed=0, attention_backend="eager"), mesh=mesh,
                                 activation_checkpointing="full", ep_overlap_chunks=2, ep_keep_exchanges=keep)
        calls.clear()
        values = _step(model, rank)
        results[keep] = {"values": values, "calls": dict(calls), "alive_after_step": _kept_rows_alive()}
        calls.clear()
        results[keep]["no_grad_loss"] = _step(model, rank, grad=False)["loss"]
        results[keep]["no_grad_calls"] = dict(calls)
        results[keep]["alive_after_no_grad"] = _kept_rows_alive()
    torch.save(results, out_dir / f"keeper{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("exchange_keeper")
    run_gloo(_worker, 2, out_dir, out_dir, timeout_s=120)
    return [torch.load(out_dir / f"keeper{rank}.pt") for rank in range(2)]


def test_kept_exchanges_give_the_same_loss_and_gradients(ranks):
    for rank, results in enumerate(ranks):
        plain = results["none"]["values"]
        assert len(plain) > 10 and any(".experts.down_proj" in name for name in plain)
        for keep in CHOICES[1:]:
            values = results[keep]["values"]
            assert sorted(values) == sorted(plain)
            for name, expected in plain.items():
                assert torch.equal(values[name], expected), (rank, keep, name)
            assert torch.equal(results[keep]["no_grad_loss"], results["none"]["no_grad_loss"])


def test_the_recomputation_exchanges_less(ranks):
    for results in ranks:
        plain, counts, combine, dispatch, both = (results[k]["calls"] for k in CHOICES)
        layers, rem = divmod(plain["rows"], 12)  # per MoE layer: 2 chunks x (dispatch, combine) x 3 passes
        assert rem == 0 and layers >= 2, plain
        assert counts["rows"] == plain["rows"]
        assert combine["rows"] == dispatch["rows"] == 10 * layers and both["rows"] == 8 * layers
        # one count exchange per forward run of a layer: the recomputation's is kept with the counts or the dispatch
        assert plain["counts"] == combine["counts"] == 2 * layers
        assert counts["counts"] == dispatch["counts"] == both["counts"] == layers
        for keep in CHOICES:  # a forward without gradients: each layer once, nothing kept or recomputed
            assert results[keep]["no_grad_calls"] == {"rows": 4 * layers, "counts": layers}


def test_nothing_kept_outlives_the_step(ranks):
    for results in ranks:
        for keep in CHOICES:
            assert results[keep]["alive_after_step"] == 0 and results[keep]["alive_after_no_grad"] == 0, keep


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["--parallel.ep", "1"], "needs parallel.ep > 1"),
    (["--parallel.activation_checkpointing", "selective"], "activation_checkpointing: full"),
    (["--parallel.compile", "true"], "compile: false"),
])
def test_the_settings_it_needs_are_refused_in_one_sentence(overrides, fragment):
    cfg = load_config("recipes/glm5/sft_4k.yaml", ["--parallel.ep_keep_exchanges", "combine", *overrides])
    errors = [e for e in check_ranges(cfg) if "ep_keep_exchanges" in e]
    assert len(errors) == 1 and fragment in errors[0], errors
    with pytest.raises(ValueError, match="ep_keep_exchanges combine: .* all_to_all dispatcher"):
        parallelize_glm5(build_model(get_preset("tiny"), seed=0), activation_checkpointing="full",
                         ep_keep_exchanges="combine")


def test_the_plan_counts_the_kept_rows():
    """sft_4k's last stage: each MoE layer keeps 4096 tokens x 8 experts x 6144 x 2 B per micro-batch and kept
    exchange beside its input, and the peak grows by that for every layer and micro-batch in flight."""
    plans = {keep: planned_for(cfg, degrees_for(cfg), 192)
             for keep in CHOICES
             for cfg in [load_config("recipes/glm5/sft_4k.yaml", ["--parallel.ep_keep_exchanges", keep])]}
    rows = 4096 * 8 * 6144 * 2
    per_layer = {keep: plan.activations_per_layer for keep, plan in plans.items()}
    assert sorted(per_layer["none"]) == sorted(per_layer["both"]) and len(per_layer["none"]) >= 18
    for layer, plain in per_layer["none"].items():
        assert per_layer["combine"][layer] - plain == per_layer["dispatch"][layer] - plain == rows
        assert per_layer["both"][layer] - plain == 2 * rows
        assert per_layer["counts"][layer] == plain  # a few bytes of counts: no rows
    saved = {keep: dict(plan.peak.parts)["activations (saved)"] for keep, plan in plans.items()}
    assert saved["combine"] - saved["none"] >= 18 * rows  # every layer of the stage, a micro-batch or more each
    assert plans["both"].peak.total > plans["combine"].peak.total > plans["none"].peak.total == plans["counts"].peak.total


def test_selective_checkpointing_refuses_kept_exchanges():
    from glmtune.models.glm5.parallelize import apply_activation_checkpointing

    with pytest.raises(ValueError, match="kept exchanges need activation_checkpointing full"):
        apply_activation_checkpointing(build_model(get_preset("tiny"), seed=0), "selective", keep_exchanges="both")


@pytest.mark.parametrize("keep", ["counts", "dispatch"])
def test_a_recomputation_that_routes_otherwise_than_its_forward_is_refused(keep):
    """Kept counts size the recomputation's exchange: were its routing to differ from the forward's (a
    nondeterministic kernel before the router), rows would reach the wrong experts. Checked on the device."""
    generator = torch.Generator().manual_seed(0)
    x_TD, weights_TK = torch.randn(6, 8, generator=generator), torch.rand(6, 2, generator=generator)
    forward_TK = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    moved_TK = forward_TK.clone()
    moved_TK[0] = torch.tensor([2, 3])  # token 0 to rank 1's experts instead of rank 0's
    with join_loopback_world(0, 2):
        dispatcher = AllToAllTokenDispatcher(dist.group.WORLD, num_local_experts=2)
        keeper = Keeper(KEPT_EXCHANGES[keep])
        with keeping(keeper, records=True):  # the forward keeps what it received
            forward = dispatcher.dispatch(x_TD, forward_TK, weights_TK, 4)
        with keeping(keeper, records=True):  # its recomputation, routed alike
            again = dispatcher.dispatch(x_TD, forward_TK, weights_TK, 4)
        assert torch.equal(again[0], forward[0]) and torch.equal(again[1], forward[1])
        with keeping(keeper, records=True), pytest.raises(RuntimeError, match="routed tokens otherwise"):
            dispatcher.dispatch(x_TD, moved_TK, weights_TK, 4)
