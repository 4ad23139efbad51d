"""Helpers for tests of HF checkpoint directories (the fixtures live in tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

from glmtune.checkpoint.hf_io import INDEX_NAME

Q_A = "model.layers.0.self_attn.q_a_proj.weight"  # [64, 128] in the tiny preset


def weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / INDEX_NAME).read_text())["weight_map"]
