"""What one rank of a recipe holds when a layer's backward begins: the live CUDA blocks of
`glmtune plan --measure`'s rank, grouped by the innermost glmtune source line that allocated them.

    python benchmarks/rank_memory_snapshot.py recipes/glm5/sft_4k.yaml --rank 192 --phase "layer 70 backward" \
        [--override --train.mtp_loss_weight 0.3]

Writes $OUT/snapshot_<rank>.txt (the top allocation sites, GiB) beside printing it.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--phase", default="layer 70 backward")
    p.add_argument("--override", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args(argv)
    cfg = load_config(a.recipe, a.override)
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
    lines = [f"{a.recipe} rank {a.rank} {' '.join(a.override)} at '{a.phase}':"]
    for site, size in taken.get(a.phase, Counter()).most_common(40):
        lines.append(f"{size / 2**30:8.2f} GiB  {site}")
    text = "\n".join(lines)
    print(text)
    out = Path(os.environ.get("OUT", "."))
    (out / f"snapshot_{a.rank}.txt").open("a").write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
