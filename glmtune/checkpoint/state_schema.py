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

Each refusal is a ValueError naming the field by its path (`scheduler.optimizer`). The RNG
states, a torch.save file of each rank, are checked for what `capture_rng` writes (`read_rng`),
their pickle first (pickle_scan.py).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch

from glmtune.checkpoint.pickle_scan import check_torch_save
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


def check_trainer_state(state: dict[str, Any], where: str, step: int, expected: dict[str, Any] | None) -> None:
    """A checkpoint's trainer state (the file `where`) is what a trainer writes: its `step` (the one
    the checkpoint's directory names) and `run_id`, and, given the state the resuming trainer would
    write now (`expected`), exactly its fields, each like the trainer's own. ValueError naming the
    file and the field."""
    saved_step, run_id = state.get("step"), state.get("run_id")
    if type(saved_step) is not int or saved_step != step:
        raise ValueError(f"{where}: step is {printable(repr(saved_step))[:40]}, the checkpoint's directory says "
                         f"{step}")
    if run_id is not None and not isinstance(run_id, str):
        raise ValueError(f"{where}: run_id is a {type(run_id).__name__}, not a run id")
    if expected is None:
        return
    fields = {key: value for key, value in state.items() if key not in ("step", "run_id")}
    check_like(fields, {key: value for key, value in expected.items() if key not in ("step", "run_id")},
               where.removesuffix(".json"))


def check_param_groups(loaded: Any, written: list[dict[str, Any]]) -> None:
    """The optimizer's param_groups read back are like the ones this optimizer writes, but for the
    parameter names, which need only be names: which parameters the saved optimizer held is checked
    against the state it saved (`CheckpointManager.load`)."""
    where = "the optimizer's param_groups"
    if not isinstance(loaded, list) or not all(isinstance(g, dict) for g in loaded):
        raise ValueError(f"{where}: not a list of groups")
    for i, group in enumerate(loaded):
        names = group.get("params")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}[{i}].params: not a list of parameter names")
    check_like([{k: v for k, v in g.items() if k != "params"} for g in loaded],
               [{k: v for k, v in g.items() if k != "params"} for g in written], where)


def read_rng(path: Path) -> dict[str, Any]:
    """A rank's RNG states as `capture_rng` wrote them; ValueError naming the file for anything else."""
    with open(path, "rb") as fh:
        check_torch_save(fh, str(path))
        state = torch.load(fh, weights_only=True)
    expected = torch.get_rng_state()
    cuda = state.get("cuda", []) if isinstance(state, dict) else None
    if not (isinstance(state, dict) and {"python", "torch"} <= set(state) <= {"python", "torch", "cuda"}
            and isinstance(state["torch"], torch.Tensor) and state["torch"].dtype == expected.dtype
            and state["torch"].shape == expected.shape and isinstance(cuda, list)
            and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
        raise ValueError(f"{path}: not the RNG states glmtune writes (python, torch and CUDA generator states)")
    try:
        random.Random().setstate(state["python"])  # Python's own check of a Mersenne Twister state
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{path}: not a Python random state ({exc})") from None
    return state
