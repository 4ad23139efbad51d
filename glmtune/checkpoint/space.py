"""Will the run's checkpoints and export fit? Checked before the first training step.

A full-disk failure found at the first save costs a whole checkpoint interval of
training. The size of a checkpoint is known before training: every saved parameter
and buffer (only the trainable ones and the buffers for adapter runs) plus AdamW's
two moments per trainable parameter, in the parameter's dtype, as DCP writes them.
Sizes are global (a DTensor's `numel()` is its full size): every rank writes its
shard to the same filesystem.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn

_SLACK = 1.05  # DCP metadata, RNG and trainer state, filesystem blocks


def checkpoint_bytes(model: nn.Module, trainable_only: bool) -> int:
    """Bytes one training checkpoint of `model` takes (model, AdamW moments, counters)."""
    total = 0
    for param in model.parameters():
        size = param.numel() * param.element_size()
        if param.requires_grad:
            total += 3 * size + 4  # the value, exp_avg, exp_avg_sq; an fp32 step counter
        elif not trainable_only:
            total += size
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                total += buf.numel() * buf.element_size()
    return int(total * _SLACK)


def export_bytes(model: nn.Module) -> int:
    """Bytes of an HF export of `model` in its parameter dtypes."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters()) * _SLACK)


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_free_space(needs: list[tuple[Path, int, str]], keep_last: int,
                     freed: dict[Path, int] | None = None) -> list[str]:
    """Refuse to start when the first checkpoint (and export) cannot fit; warn when later ones may not.

    Args:
        needs: (directory, bytes, what) for each output, e.g. (checkpoint.dir, 12e9, "one checkpoint").
        keep_last: checkpoints kept at once (0: all); a save needs room for one more.
        freed: (directory, bytes) removed before the first save (an --overwrite's set-aside run),
            counted as free on the directory's filesystem.

    Returns:
        warning lines for the console.

    Raises:
        ValueError: naming the directory, the free and the needed bytes.
    """
    by_device: dict[int, list[tuple[Path, int, str]]] = {}
    for directory, num_bytes, what in needs:
        by_device.setdefault(os.stat(_existing_parent(directory)).st_dev, []).append((directory, num_bytes, what))
    credit: dict[int, int] = {}
    for directory, num_bytes in (freed or {}).items():
        device = os.stat(_existing_parent(directory)).st_dev
        credit[device] = credit.get(device, 0) + num_bytes
    warnings = []
    for device, entries in by_device.items():
        where = _existing_parent(entries[0][0])
        free = shutil.disk_usage(where).free + credit.get(device, 0)
        needed = sum(num_bytes for _, num_bytes, _ in entries)
        if free < needed:
            parts = " + ".join(f"{what} {_gb(num_bytes)}" for _, num_bytes, what in entries)
            raise ValueError(f"not enough disk space for {', '.join(str(d) for d, _, _ in entries)}: "
                             f"{_gb(free)} free on {where}, this run needs {_gb(needed)} ({parts}); free space, "
                             "or point checkpoint.dir / logging.run_dir at a larger disk")
        checkpoint = next((num_bytes for _, num_bytes, what in entries if "checkpoint" in what), 0)
        # While saving, keep_last older checkpoints are still on disk beside the new one.
        if checkpoint and keep_last and free < needed + checkpoint * keep_last:
            warnings.append(f"disk space: {_gb(free)} free on {where} holds the first checkpoint "
                            f"({_gb(checkpoint)}) but not {keep_last + 1} at once, as checkpoint.keep_last "
                            f"{keep_last} needs while saving; a later save may fail")
    return warnings


def _gb(num_bytes: float) -> str:
    if num_bytes >= 1e9:
        return f"{num_bytes / 1e9:.1f} GB"
    return f"{num_bytes / 1e6:.1f} MB"
