"""What one rank of a recipe holds when a layer's backward begins, or at its peak: the live CUDA
blocks of `glmtune plan --measure`'s rank, grouped by the innermost glmtune source line that
allocated them.

    python benchmarks/rank_memory_snapshot.py recipes/glm5/sft_4k.yaml --rank 192 --phase "layer 70 backward" \
        [--override --train.mtp_loss_weight 0.3]
    python benchmarks/rank_memory_snapshot.py recipes/glm5/sft_4k.yaml --rank 192 --at-peak

`--at-peak` records the allocator's history from before the rank is built and replays it
(`live_at_peak`): allocations add their size, frees subtract it when the caller frees the block
(the allocator's "allocated" count, which `torch.cuda.max_memory_allocated` peaks), and the blocks
alive at the largest total are the peak's. The replayed peak is printed beside the allocator's
own; they agree when the history held every event. Writes $OUT/snapshot_<rank>.txt (the top
allocation sites, GiB) beside printing it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmtune.config import load_config  # noqa: E402
from glmtune.plan import measure  # noqa: E402
from glmtune.plan.planner import degrees_for  # noqa: E402

MAX_ENTRIES = 4_000_000  # allocator events kept: a real-size rank's build, warm-up and timed step


def _site(frames: list[dict]) -> str:
    """The innermost glmtune source line of an allocation, and the innermost frame itself when it is
    another library's (e.g. FSDP2's all-gather buffers, allocated under a pipeline schedule's step)."""
    def where(frame: dict) -> str:
        name = frame.get("filename", "?")
        short = name.split("/glmtune/")[-1] if "/glmtune/" in name else "/".join(name.split("/")[-3:])
        return f"{short}:{frame.get('line')} {frame.get('name')}"

    inner = next((f for f in frames if f.get("filename", "").endswith(".py")), frames[0] if frames else None)
    ours = next((f for f in frames if "/glmtune/" in f.get("filename", "")), None)
    if ours is None:
        return where(inner) if inner else "?"
    return where(ours) if inner is ours or inner is None else f"{where(ours)} <- {where(inner)}"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """(the largest allocated total, the alloc entries alive then) of an allocator trace (one
    device's `torch.cuda.memory._snapshot()["device_traces"]` list: entries with action, addr, size,
    frames), replayed from nothing: "alloc" adds a block, "free_requested" removes it."""
    live: dict[int, dict] = {}
    total = peak = 0
    peak_at = -1
    for i, entry in enumerate(trace):
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry
            total += entry["size"]
            if total > peak:
                peak, peak_at = total, i
        elif entry["action"] == "free_requested" and entry["addr"] in live:
            total -= live.pop(entry["addr"])["size"]
    alive: dict[int, dict] = {}
    for entry in trace[:peak_at + 1]:  # replayed again up to the peak: no copy of the live set per event
        if entry["action"] == "alloc":
            alive[entry["addr"]] = entry
        elif entry["action"] == "free_requested":
            alive.pop(entry["addr"], None)
    return peak, list(alive.values())


def _sites(blocks) -> Counter:
    sites: Counter = Counter()
    for block in blocks:
        sites[_site(block.get("frames", []))] += block["size"]
    return sites


def _at_peak(cfg, rank: int) -> tuple[str, Counter]:
    """The rank's live blocks at its replayed peak, by site, and a header line with both peaks."""
    # Python-only stacks fail inside a checkpoint's recomputation on torch 2.11 (an autograd Function's
    # apply "returned NULL without setting an exception"); C++ frames are symbolized when the snapshot
    # is taken. Frees keep no stack (context "alloc"): the replay needs only their addresses.
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context="alloc", stacks="all")
    measure.measure_rank(cfg, degrees_for(cfg), rank, steps=1, warmup=1)
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    peak, blocks = live_at_peak(trace)
    note = " (the history filled up: early events are missing)" if len(trace) >= MAX_ENTRIES else ""
    return (f"replayed peak {peak / 2**30:.2f} GiB, allocator's {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
            f"{len(trace)} events{note}"), _sites(blocks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--phase", default="layer 70 backward")
    p.add_argument("--at-peak", action="store_true", help="the live blocks at the rank's peak instead of a phase")
    p.add_argument("--override", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args(argv)
    cfg = load_config(a.recipe, a.override)
    if a.at_peak:
        header, sites = _at_peak(cfg, a.rank)
        return _write(f"{a.recipe} rank {a.rank} {' '.join(a.override)} at its peak: {header}", sites, a.rank)
    taken: dict[str, Counter] = {}
    original = measure._PhaseProbe.note

    def note(self, phase: str) -> None:
        original(self, phase)
        if self.on and self.recording and phase == a.phase and phase not in taken:
            sites: Counter = Counter()
            for segment in torch.cuda.memory._snapshot()["segments"]:
                for block in segment["blocks"]:
                    if block["state"] == "active_allocated":
                        sites[_site(block.get("frames", []))] += block["size"]
            taken[phase] = sites

    measure._PhaseProbe.note = note
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    measure.measure_rank(cfg, degrees_for(cfg), a.rank, steps=1, warmup=1)
    return _write(f"{a.recipe} rank {a.rank} {' '.join(a.override)} at '{a.phase}':", taken.get(a.phase, Counter()),
                  a.rank)


def _write(header: str, sites: Counter, rank: int) -> int:
    lines = [header] + [f"{size / 2**30:8.2f} GiB  {site}" for site, size in sites.most_common(40)]
    text = "\n".join(lines)
    print(text)
    out = Path(os.environ.get("OUT", "."))
    with (out / f"snapshot_{rank}.txt").open("a") as f:
        f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
