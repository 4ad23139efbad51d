"""The replay mix's loader (glmtune/train/mix_loader.py): each source's share of the drawn target tokens
follows its weight, the order is the seed's, a resumed loader continues the same order, and the ranks
split the same global order."""

from __future__ import annotations

import pytest

from glmtune.train.data_loader import PackedRowLoader
from glmtune.train.mix_data import MixSources, target_tokens
from glmtune.train.mix_loader import MixedRowLoader

LENGTH = 32


def _row(source: int, index: int, targets: int) -> dict[str, list[int]]:
    """A packed row of one document whose first `targets` next-token labels are scored; its tokens
    name it (source * 1000 + index), so a batch says which rows it holds."""
    labels = [source * 1000 + index] * (targets + 1) + [-100] * (LENGTH - targets - 1)
    return {"input_ids": [source * 1000 + index] * LENGTH, "labels": labels, "position_ids": list(range(LENGTH)),
            "document_ids": [0] * LENGTH}


def _mix(weight: float = 0.2) -> tuple[list, MixSources]:
    """A domain of 40 rows of 20 to 31 targets (text-like), a replay of 25 rows of 2 to 8 (chat-like)."""
    domain = [_row(0, i, 20 + i % 12) for i in range(40)]
    replay = [_row(1, i, 2 + i % 7) for i in range(25)]
    return domain + replay, MixSources(("domain", "replay"), (1 - weight, weight), [0] * 40 + [1] * 25,
                                       {"domain": [], "replay": []})


def _ids(loader, batches: int) -> list[list[int]]:
    return [loader.next_batch()["input_ids"][:, 0].tolist() for _ in range(batches)]


@pytest.mark.parametrize("weight", [0.05, 0.2, 0.5, 0.9])
def test_target_token_shares_follow_the_weights(weight):
    rows, mix = _mix(weight)
    loader = MixedRowLoader(rows, mix, micro_batch_size=4, seed=7)
    drawn = [row for batch in _ids(loader, 500) for row in batch]  # 2,000 rows: many epochs of each source
    targets = {0: 0, 1: 0}
    for token in drawn:
        targets[token // 1000] += target_tokens(rows[token % 1000 + (40 if token >= 1000 else 0)])
    total = sum(targets.values())
    # the stated bound: each share is within one row's targets (at most 31) of its weight
    assert abs(targets[1] / total - weight) <= 31 / total
    assert abs(targets[1] / total - weight) < 0.002
    assert loader.drawn == [targets[0], targets[1]]
    window = loader.window_mix()  # the whole run is one window here
    assert window == pytest.approx({"mix/domain": targets[0] / total, "mix/replay": targets[1] / total})
    assert loader.window_mix() == {"mix/domain": 0.0, "mix/replay": 0.0}  # a new, empty window


def test_every_window_stays_near_the_weight():
    rows, mix = _mix(0.2)
    loader = MixedRowLoader(rows, mix, micro_batch_size=4, seed=0)
    for _ in range(20):  # windows of 10 steps of 8 rows
        _ids(loader, 20)
        share = loader.window_mix()["mix/replay"]
        assert abs(share - 0.2) < 0.03, share


def test_each_source_goes_through_all_its_rows_before_repeating_one():
    rows, mix = _mix(0.5)
    loader = MixedRowLoader(rows, mix, micro_batch_size=1, seed=3)
    drawn = [batch[0] for batch in _ids(loader, 300)]
    replay = [token for token in drawn if token >= 1000]
    assert len(replay) >= 50
    assert sorted(replay[:25]) == list(range(1000, 1025)) and sorted(replay[25:50]) == list(range(1000, 1025))
    assert replay[:25] != replay[25:50]  # each epoch its own permutation


def test_the_order_is_the_seeds():
    rows, mix = _mix()
    first = _ids(MixedRowLoader(rows, mix, micro_batch_size=4, seed=11), 60)
    assert _ids(MixedRowLoader(rows, mix, micro_batch_size=4, seed=11), 60) == first
    assert _ids(MixedRowLoader(rows, mix, micro_batch_size=4, seed=12), 60) != first


@pytest.mark.parametrize("stopped_after", [1, 9, 10, 37])
def test_a_resumed_loader_continues_the_same_order(stopped_after):
    rows, mix = _mix()
    straight = MixedRowLoader(rows, mix, micro_batch_size=4, seed=5)
    before = _ids(straight, stopped_after)
    state = straight.state_dict()
    straight.window_mix()  # a logged step: the resumed run's first window starts here too
    after = _ids(straight, 40)
    resumed = MixedRowLoader(rows, mix, micro_batch_size=4, seed=5)
    resumed.load_state_dict(state)
    assert _ids(resumed, 40) == after
    assert before  # the state described a real position
    assert resumed.window_mix()["mix/replay"] == pytest.approx(straight.window_mix()["mix/replay"])


def test_a_resume_refuses_another_mix_by_name():
    rows, mix = _mix(0.2)
    state = MixedRowLoader(rows, mix, micro_batch_size=4, seed=5).state_dict()
    _, other = _mix(0.3)
    with pytest.raises(ValueError, match=r"weights=\[0\.8, 0\.2\], this run has weights=\[0\.7, 0\.3\]"):
        MixedRowLoader(rows, other, micro_batch_size=4, seed=5).load_state_dict(state)


def test_ranks_split_the_one_process_order():
    rows, mix = _mix()
    whole = _ids(MixedRowLoader(rows, mix, micro_batch_size=4, seed=2), 30)
    ranks = [_ids(MixedRowLoader(rows, mix, micro_batch_size=2, seed=2, rank=r, world_size=2), 30) for r in (0, 1)]
    assert [a + b for a, b in zip(*ranks)] == whole


def test_the_state_has_the_plain_loaders_fields():
    """The checkpoint's position check (resume_state.check_position) reads the plain loader's fields."""
    rows, mix = _mix()
    mixed = MixedRowLoader(rows, mix, micro_batch_size=4, seed=5)
    plain = PackedRowLoader(rows, micro_batch_size=4, seed=5)
    assert set(plain.state_dict()) < set(mixed.state_dict())
    assert mixed.batches_per_epoch == plain.batches_per_epoch


def test_a_source_without_rows_is_refused():
    rows, _ = _mix()
    mix = MixSources(("domain", "replay"), (0.8, 0.2), [0] * len(rows), {})
    with pytest.raises(ValueError, match="replay source has no packed training rows"):
        MixedRowLoader(rows, mix, micro_batch_size=4, seed=0)
