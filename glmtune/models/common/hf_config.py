"""An HF checkpoint's config.json, read with one sentence for each way it can be unreadable.

The model registry reads it to find the family (`model_type`), and each family's args read
it for the architecture: both with the same refusals. The file is whatever the directory
holds, so it is read bounded (`MAX_CONFIG_BYTES`, nesting `MAX_CONFIG_DEPTH`: a config is a
few kilobytes a few levels deep) and every way it fails names it; a FIFO, socket or device
there is named for what it is and never opened to wait on (`glmtune.io.regular`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from glmtune.io.regular import kind_of, open_regular

MAX_CONFIG_BYTES = 16 << 20
MAX_CONFIG_DEPTH = 32


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory, or of the file `path` names."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if kind_of(path) in ("missing", "a link to nothing"):
        raise FileNotFoundError(f"{path}: no config.json")
    with open_regular(path) as fh:  # anything but a regular file: named for what it is
        raw = fh.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: more than {MAX_CONFIG_BYTES:,} bytes, not a model config")
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deep for a config") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a config (a JSON object)")
    if _depth(config) > MAX_CONFIG_DEPTH:
        raise ValueError(f"{path}: JSON nested deeper than {MAX_CONFIG_DEPTH} levels, too deep for a config")
    return config
