"""An HF checkpoint's config.json, read with one sentence for each way it can be unreadable.

The model registry reads it to find the family (`model_type`), and each family's args read
it for the architecture: both with the same refusals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory, or of the file `path` names."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deep for a config") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a config (a JSON object)")
    return config
