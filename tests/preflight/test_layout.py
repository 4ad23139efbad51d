"""layout.py: the GLM-5 recipes' topologies scaled down, and fitted to the processes given."""

from __future__ import annotations

from glmtune.config import load_config
from glmtune.preflight.layout import scaled_replica


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
