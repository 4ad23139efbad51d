"""`parallel.ep_overlap_chunks` (schema.py ParallelConfig): refused in one sentence where it cannot take
effect (no expert parallelism, the all_gather dispatcher, fewer than 1 chunk), and handed to the GLM-5
parallelization plan where it can (the chunked schedule itself: tests/distributed/test_ep_overlap.py and
test_expert_parallel_train.py)."""

from __future__ import annotations

import pytest

from glmtune.config import load_config, validate_config
from glmtune.config.schema import ParallelConfig
from glmtune.models.glm5 import spec as glm5_spec
from glmtune.models.registry import model_dims

RECIPE = "recipes/tiny/sft_support_json.yaml"


def _validate(*overrides: str) -> None:
    cfg = load_config(RECIPE, list(overrides))
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=2)


@pytest.mark.parametrize("overrides", [
    ["--parallel.ep_overlap_chunks", "2"],  # no expert parallelism: nothing to overlap
    ["--parallel.ep_overlap_chunks", "0", "--parallel.ep", "2"],
    ["--parallel.ep_overlap_chunks", "2", "--parallel.ep", "2", "--parallel.ep_dispatcher", "all_gather"],
], ids=["no-ep", "zero", "all-gather"])
def test_what_cannot_take_effect_is_refused(overrides):
    with pytest.raises(ValueError, match=r"parallel.ep_overlap_chunks: -?\d+ must be 1, or more with parallel.ep > 1"):
        _validate(*overrides)


def test_two_chunks_at_ep2_validate():
    _validate("--parallel.ep_overlap_chunks", "2", "--parallel.ep", "2")


def test_the_plan_is_handed_the_chunks(monkeypatch):
    seen = {}
    monkeypatch.setattr(glm5_spec, "parallelize_glm5", lambda model, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(glm5_spec.Glm5Compute, "step_runner", lambda self, model: None)
    glm5_spec.GLM5.compute.parallelize(object(), None, ParallelConfig(ep=2, ep_overlap_chunks=3))
    assert seen["ep_overlap_chunks"] == 3
