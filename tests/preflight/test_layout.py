"""layout.py: the GLM-5 recipes' topologies scaled down, and fitted to the processes given."""

from __future__ import annotations

import pytest

from glmtune.config import load_config, validate_config
from glmtune.models.registry import model_dims
from glmtune.preflight.layout import ONE_PROCESS, UNPINNED_TOPOLOGY, scaled_replica


def _parallel(name):
    return load_config(name).parallel


def test_each_axis_at_two():
    replica = scaled_replica(_parallel("glm5/sft_32k_cp8"))
    assert (replica.world, replica.pp, replica.cp, replica.ep, replica.dp) == (8, 2, 2, 2, 2)
    assert replica.batch == ["--train.micro_batch_size", "2", "--train.global_batch_size", "8"]
    assert not replica.not_exercised


def test_fitted_to_two_processes_names_what_does_not_fit():
    replica = scaled_replica(_parallel("glm5/sft_32k_cp8"), world=2, micro_batch_size=2, accumulation=1)
    assert (replica.world, replica.pp, replica.cp, replica.ep, replica.dp) == (2, 2, 1, 1, 1)
    assert [m.split()[0] for m in replica.not_exercised] == ["cp", "ep"]
    lora = scaled_replica(_parallel("glm5/lora_4k"), world=2, micro_batch_size=1, accumulation=1)
    assert (lora.ep, lora.dp, lora.batch[-1]) == (2, 2, "2") and lora.describe() == "2 processes: dp 2, ep 2"
    eight = scaled_replica(_parallel("tiny/sft_support_json"), world=8, micro_batch_size=1, accumulation=1)
    assert (eight.world, eight.dp) == (8, 8)


GLM5_RECIPES = ["glm5/sft_4k", "glm5/sft_32k_cp8", "glm5/lora_4k", "glm5/lora_fp8_1node", "glm5/dpo_lora_fp8_1node"]
DUALPIPEV_PAIRED = ["--parallel.pp_schedule", "DualPipeV", "--parallel.pp_stages_per_rank", "2",
                    "--train.micro_batch_size", "8", "--train.global_batch_size", "512",
                    "--parallel.pp_microbatches", "8", "--parallel.pp_ep_overlap", "true"]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("recipe, extra", [*[(r, []) for r in GLM5_RECIPES], ("glm5/sft_4k", DUALPIPEV_PAIRED)],
                         ids=[*GLM5_RECIPES, "glm5/sft_4k-dualpipev-paired"])
def test_the_scaled_layout_and_the_one_process_run_validate(recipe, extra, world):
    """What preflight runs must pass validation: the expert all-to-all's settings (chunks, kept exchanges,
    the paired overlap) where ep or pp falls to 1, and DualPipeV's microbatches (at least its stages)."""
    cfg = load_config(recipe, extra)
    replica = scaled_replica(cfg.parallel, world, micro_batch_size=2 if cfg.parallel.pp > 1 else 1, accumulation=1)
    for overrides, processes in (([*UNPINNED_TOPOLOGY, *replica.layout, *replica.batch], replica.world),
                                 ([*UNPINNED_TOPOLOGY, *ONE_PROCESS, *replica.batch], 1)):
        scaled = load_config(recipe, [*extra, *overrides, "--train.generate_samples", "0"])
        dims = model_dims(scaled.model)
        validate_config(scaled, dims.num_experts, dims.num_layers, world_size=processes)
