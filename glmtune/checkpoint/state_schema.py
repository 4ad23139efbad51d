"""State read back from a checkpoint, checked against what the writer writes before it is applied.

A resume hands the trainer state (`trainer_state.json`) and the optimizer's non-tensor values
(`param_groups`, read back through DCP) to `load_state_dict` methods that trust them: an LR
scheduler's is `self.__dict__.update(state)`, so an extra key sets any attribute (`optimizer`,
and the run dies steps later), a dict in `lr_lambdas` updates a function's attributes, a string
where a number was ends in a TypeError mid-training. So what is read is compared with what the
running objects write now (`template`: the state a fresh trainer would save), field by field:

  * an object has exactly the template's keys (a missing or an unknown key is named);
  * a list or tuple has the template's length, each item checked against the template's;
  * a number is a finite number, an integer where the template's is, and not negative where
    the template's is not; a boolean, a string, `None` are the same kind as the template's;
  * a tensor has the template's dtype and shape.

Each refusal is a ValueError naming the field by its path (`scheduler.optimizer`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from glmtune.io.text_limits import printable


def _kind_problem(value: Any, template: Any) -> str | None:
    """Why the leaf `value` is not the kind of value `template` is (None when it is)."""
    if isinstance(template, bool) or template is None or isinstance(template, str):
        kind = bool if isinstance(template, bool) else type(template)
        return None if type(value) is kind else f"is {_named(value)}, not {_named(template)}"
    if isinstance(template, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"is {_named(value)}, not a number"
        if isinstance(template, int) and not isinstance(value, int):
            return f"is {value!r:.40}, not an integer"
        if not math.isfinite(value):
            return f"is {value!r}, not a finite number"
        return f"is {value!r:.40}, a negative number" if template >= 0 > value else None
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return f"is {_named(value)}, not a tensor"
        if value.dtype != template.dtype or value.shape != template.shape:
            return f"is a {value.dtype} tensor of shape {tuple(value.shape)}, not {template.dtype} {tuple(template.shape)}"
        return None
    raise AssertionError(f"no rule for a template value of type {type(template).__name__}")


def _named(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def check_like(value: Any, template: Any, where: str) -> None:
    """ValueError naming the first field of `value` that is not like `template`'s (module docstring).

    Follows the template's structure, so its depth bounds the work, whatever `value` holds.
    """
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: is {_named(value)}, not an object")
        for key in value:
            if key not in template:
                raise ValueError(f"{where}.{printable(key)[:80]}: not a field glmtune writes")
        for key, item in template.items():
            if key not in value:
                raise ValueError(f"{where}.{key}: missing")
            check_like(value[key], item, f"{where}.{key}")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: is {_named(value)}, not a list")
        if len(value) != len(template):
            raise ValueError(f"{where}: {len(value)} items, glmtune writes {len(template)} here")
        for i, (item, expected) in enumerate(zip(value, template)):
            check_like(item, expected, f"{where}[{i}]")
    else:
        problem = _kind_problem(value, template)
        if problem:
            raise ValueError(f"{where}: {problem}")
