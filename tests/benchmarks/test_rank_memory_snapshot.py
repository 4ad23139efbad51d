"""benchmarks/rank_memory_snapshot.py --at-peak: the allocator's history replayed to its peak."""

from __future__ import annotations

from benchmarks.rank_memory_snapshot import live_at_peak


def _event(action: str, addr: int, size: int, line: int) -> dict:
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/x/glmtune/models/glm5/moe.py", "line": line, "name": "forward"}]}


def test_the_blocks_alive_at_the_largest_total_are_the_peaks():
    trace = [
        _event("alloc", 1, 100, 10),
        _event("alloc", 2, 300, 11),
        _event("free_requested", 2, 300, 11),
        _event("free_completed", 2, 300, 11),  # the caller's free already counted: no second subtraction
        _event("alloc", 3, 250, 12),  # 350
        _event("alloc", 2, 120, 13),  # the address again, another block: 470, the peak
        _event("free_requested", 1, 100, 10),
        _event("alloc", 4, 50, 14),  # 420
        _event("free_requested", 99, 10**9, 15),  # allocated before the history: not in the replay
    ]
    peak, blocks = live_at_peak(trace)
    assert peak == 470
    assert sorted((b["addr"], b["size"]) for b in blocks) == [(1, 100), (2, 120), (3, 250)]


def test_an_empty_history_has_no_peak():
    assert live_at_peak([]) == (0, [])
