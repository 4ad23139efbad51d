"""JSON that glmtune writes (a scorecard, `--json` on stdout) as RFC 8259 JSON, whatever it holds.

`json.dumps` writes a float NaN or infinity as a bare `NaN` / `Infinity`, which is not JSON:
`jq`, `JSON.parse` and most other readers refuse the whole file. Such a value can reach what
glmtune writes from outside (a data row's tool call, a tool function's result, a loss that
diverged), so `dumps` writes it as the string `"NaN"`, `"Infinity"` or `"-Infinity"`: the value
stays visible (a null would read as "not measured") and the file stays JSON. It is
`json.dumps(..., allow_nan=False)` on the value as it is when the value holds no such number
(no copy), else on a copy with those strings in their place.
"""

from __future__ import annotations

import json
import math
from typing import Any

_NAMES = {math.inf: "Infinity", -math.inf: "-Infinity"}


def _spelled(value: float) -> str:
    return _NAMES.get(value, "NaN")


def finite(value: Any) -> Any:
    """`value` with every non-finite float (as a dict key too) replaced by its spelling as a string."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _spelled(value)
    if isinstance(value, dict):
        return {(_spelled(k) if isinstance(k, float) and not math.isfinite(k) else k): finite(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps(value, **options)` as RFC 8259 JSON (module docstring)."""
    try:
        return json.dumps(value, allow_nan=False, **options)
    except ValueError:  # "Out of range float values are not JSON compliant"; a cycle would be a bug
        return json.dumps(finite(value), allow_nan=False, **options)
