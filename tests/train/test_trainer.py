"""The loop itself, on a model it knows nothing about: accumulation invariance,
non-finite loss handling, checkpoint atomicity and retention."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from glmtune.checkpoint.manager import CheckpointManager
from glmtune.models.common.step_runner import PlainRunner
from glmtune.train.data_loader import PackedRowLoader
from glmtune.train.lr_schedule import build_scheduler
from glmtune.train.metrics import MetricsWriter
from glmtune.train.trainer import NonFiniteLossError, Trainer, TrainerSettings


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)


def _rows(n=16, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 32, (length,), generator=g).tolist()
        labels = [-100] + ids[1:]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": list(range(length)),
                     "document_ids": [0] * length})
    return rows


def _loss(model, mb):
    logits = model.head(model.embed(mb.input_ids)).float()
    targets = mb.targets.reshape(-1)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="sum",
                                       ignore_index=-100)
    return loss, (targets != -100).sum()


def _token_logps(model, mb):
    logits = model.head(model.embed(mb.input_ids)).float()
    return logits.log_softmax(-1).gather(-1, mb.targets.clamp_min(0)[..., None])[..., 0] * (mb.targets != -100)


def _runner(model, loss_fn=_loss) -> PlainRunner:
    """The step runner of a model the trainer knows nothing about: `loss_fn` as its family's loss."""
    return PlainRunner(model, loss_fn, _token_logps)


def _trainer(tmp_path, micro, accum, loss_fn=_loss, steps=4, every=0, lr=1e-2, weight_decay=0.01):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = build_scheduler(opt, 0, steps, "constant", 1.0)
    loader = PackedRowLoader(_rows(), micro, seed=3)
    settings = TrainerSettings(max_steps=steps, grad_accum=accum, clip_grad_norm=None, log_every=1, val_every=0,
                               val_steps=None, checkpoint_every=every, progress=False)
    metrics = MetricsWriter(tmp_path, "metrics.jsonl", tensorboard=False)
    return Trainer(model, opt, sched, _runner(model, loss_fn), loader, None,
                   CheckpointManager(tmp_path / "ckpt", keep_last=2),
                   metrics, settings)


def test_micro_batch_split_does_not_change_the_update(tmp_path):
    a = _trainer(tmp_path / "a", micro=4, accum=1).fit()
    b = _trainer(tmp_path / "b", micro=1, accum=4).fit()
    assert a.losses == pytest.approx(b.losses, rel=1e-5)


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path):
    calls = {"n": 0}

    def flaky(model, mb):
        calls["n"] += 1
        loss, count = _loss(model, mb)
        return (loss * math.nan if calls["n"] == 3 else loss), count

    trainer = _trainer(tmp_path, micro=2, accum=1, loss_fn=flaky, steps=6, every=2)
    with pytest.raises(NonFiniteLossError, match="at step 3"):
        trainer.fit()
    kept = trainer.checkpoints.latest()
    assert kept.step == 2
    assert trainer.step == 2  # the bad step did not update anything


def test_partial_checkpoints_are_never_picked_and_retention(tmp_path):
    trainer = _trainer(tmp_path, micro=2, accum=1, steps=6, every=1)
    trainer.fit()
    manager = trainer.checkpoints
    assert [c.step for c in manager.complete()] == [5, 6]
    (manager.root / ".step-00000007.partial").mkdir()
    (manager.root / "step-00000009").mkdir()  # no trainer state: incomplete
    assert manager.latest().step == 6


def test_save_at_end_false_skips_only_the_final_save(tmp_path):
    """checkpoint.save_at_end false: no save after the last step; every_steps saves and stop requests still save."""
    default = _trainer(tmp_path / "default", micro=2, accum=1, steps=3)
    assert default.fit().checkpoint is not None
    assert [c.step for c in default.checkpoints.complete()] == [3]
    none = _trainer(tmp_path / "none", micro=2, accum=1, steps=3)
    none.s.save_at_end = False
    assert none.fit().checkpoint is None
    assert none.checkpoints.complete() == []
    periodic = _trainer(tmp_path / "periodic", micro=2, accum=1, steps=3, every=2)
    periodic.s.save_at_end = False
    periodic.fit()
    assert [c.step for c in periodic.checkpoints.complete()] == [2]
    stopped = _trainer(tmp_path / "stopped", micro=2, accum=1, steps=3)
    stopped.s.save_at_end, stopped.s.stop_file = False, tmp_path / "STOP_REQUESTED"
    stopped.s.stop_file.touch()
    assert stopped.fit().interrupted
    assert [c.step for c in stopped.checkpoints.complete()] == [1]


def test_async_save_becomes_visible_and_resumes_exactly(tmp_path):
    straight = _trainer(tmp_path / "straight", micro=2, accum=1, steps=6).fit()
    first = _trainer(tmp_path / "run", micro=2, accum=1, steps=3, every=3)
    first.s.async_save = True
    first.fit()
    assert first.checkpoints.latest().step == 3
    second = _trainer(tmp_path / "run", micro=2, accum=1, steps=6)
    assert second.resume("auto") == 3
    assert straight.losses[3:] == second.fit().losses


def test_wandb_without_package_is_a_clear_error(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ValueError, match="logging.wandb"):
        MetricsWriter(tmp_path, "m.jsonl", tensorboard=False, wandb_project="proj")


def test_non_finite_gradient_with_finite_loss_stops(tmp_path):
    def exploding(model, mb):
        loss, count = _loss(model, mb)
        # adds 0 to the value; d sqrt(u)/du is inf at u = 0, so the bias gradient is nan
        return loss + torch.sqrt(model.head.bias.sum() * 0.0), count

    trainer = _trainer(tmp_path, micro=2, accum=1, loss_fn=exploding, steps=3, every=1)
    with pytest.raises(NonFiniteLossError, match="gradient norm"):
        trainer.fit()
    assert trainer.step == 0 and trainer.checkpoints.latest() is None


def test_resume_from_older_checkpoint_sets_newer_ones_aside(tmp_path):
    first = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    first.fit()
    older = first.checkpoints.complete()[0]
    assert older.step == 2
    again = _trainer(tmp_path, micro=2, accum=1, steps=4, every=2)
    assert again.resume(str(older.path)) == 2
    assert [c.step for c in again.checkpoints.complete()] == [2]
    assert any(p.name.startswith("abandoned-step-00000004") for p in again.checkpoints.root.iterdir())


def test_loader_refuses_a_different_layout():
    loader = PackedRowLoader(_rows(), 2, seed=3)
    loader.next_batch()
    state = loader.state_dict()
    with pytest.raises(ValueError, match="micro_batch_size=2"):
        PackedRowLoader(_rows(), 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=3"):
        PackedRowLoader(_rows(), 2, seed=4).load_state_dict(state)
    same = PackedRowLoader(_rows(), 2, seed=3)
    same.load_state_dict(state)
    assert torch.equal(same.next_batch()["input_ids"], loader.next_batch()["input_ids"])


def test_batches_carry_the_longest_document_from_the_host():
    rows = _rows(n=2)
    rows[0].update(position_ids=[*range(5), *range(7)], document_ids=[0] * 5 + [1] * 7)
    rows[1].update(position_ids=[*range(3), *range(9)], document_ids=[0] * 3 + [1] * 9)
    batch = PackedRowLoader(rows, 2, seed=3).next_batch()
    assert batch["longest_document"] == 9  # the model then needs no host sync to pick its attention path


class FakeMoE(nn.Module):
    """What the router-bias update reads and writes: a load per expert and the gate's bias."""

    def __init__(self):
        super().__init__()
        self.register_buffer("tokens_per_expert", torch.tensor([3.0, 1.0]))
        self.gate = nn.Module()
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(2))


def test_the_router_bias_update_waits_out_the_indexer_warm_up(tmp_path):
    """`router_bias_after` (an indexer warm-up of N steps trains the indexers alone): the first N
    steps leave the routing biases as they are, each later step moves them by the rate."""
    biases = {}
    for after in (0, 2):
        torch.manual_seed(0)
        model, moe = TinyLM(), FakeMoE()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        settings = TrainerSettings(max_steps=3, grad_accum=1, clip_grad_norm=None, log_every=1, val_every=0,
                                   val_steps=None, checkpoint_every=0, progress=False, save_at_end=False,
                                   router_bias_update="sign", router_bias_rate=0.5, moe_layers=[("moe", moe)],
                                   router_bias_after=after)
        runner = PlainRunner(model, _loss, _token_logps, moe_layers=[("moe", moe)])  # its expert loads
        Trainer(model, opt, build_scheduler(opt, 0, 3, "constant", 1.0), runner,
                PackedRowLoader(_rows(), 2, seed=3),
                None, CheckpointManager(tmp_path / f"ckpt{after}"), MetricsWriter(tmp_path / f"m{after}",
                "metrics.jsonl", tensorboard=False), settings).fit()
        biases[after] = moe.gate.e_score_correction_bias.tolist()
    assert biases == {0: [-1.5, 1.5], 2: [-0.5, 0.5]}  # the loaded expert down, the idle one up
