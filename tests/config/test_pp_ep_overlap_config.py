"""`parallel.pp_ep_overlap` (DualPipeV's paired forward and backward taking turns at the expert
all-to-alls, glmtune/distributed/paired_overlap.py): refused in one sentence where it cannot take
effect, before anything is built, and handed to the GLM-5 plan where it can (the training run:
tests/distributed/test_expert_parallel_train.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glmtune.config import load_config, validate_config
from glmtune.models.glm5.spec import GLM5
from glmtune.models.registry import model_dims
from glmtune.train.run import pipeline_options

RECIPE = "recipes/tiny/sft_support_json.yaml"
DUALPIPEV = ["--parallel.pp", "2", "--parallel.ep", "2", "--parallel.pp_schedule", "DualPipeV",
             "--parallel.pp_stages_per_rank", "2", "--train.micro_batch_size", "4", "--train.global_batch_size", "8",
             "--train.generate_samples", "0"]


def _validate(*overrides: str):
    cfg = load_config(RECIPE, list(overrides))
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=4)
    return cfg


@pytest.mark.parametrize("overrides", [
    [*DUALPIPEV[:4], *DUALPIPEV[8:]],  # the recipe's 1F1B: one stage per rank, no paired actions
    [*DUALPIPEV, "--parallel.ep", "1"],
    [*DUALPIPEV, "--parallel.ep_dispatcher", "all_gather"],
    [*DUALPIPEV, "--parallel.compile", "true"],
], ids=["not-dualpipev", "no-ep", "all-gather", "compiled"])
def test_what_cannot_take_effect_is_refused(overrides):
    with pytest.raises(ValueError, match=r"parallel.pp_ep_overlap pairs DualPipeV's forwards and backwards"):
        _validate(*overrides, "--parallel.pp_ep_overlap", "true")


def test_without_a_pipeline_it_is_refused():
    with pytest.raises(ValueError, match=r"parallel.pp_ep_overlap is set but parallel.pp is 1"):
        _validate("--parallel.ep", "2", "--parallel.pp_ep_overlap", "true")


def test_dualpipev_with_ep_validates_and_reaches_the_pipeline_options():
    cfg = _validate(*DUALPIPEV, "--parallel.pp_ep_overlap", "true")
    launch = SimpleNamespace(degrees=SimpleNamespace(pp=2), spec=GLM5, precision=SimpleNamespace(
        compute_dtype=torch.float32), device=torch.device("cpu"))
    assert pipeline_options(cfg, launch).ep_overlap
    assert not pipeline_options(_validate(*DUALPIPEV), launch).ep_overlap
