"""`train.objective: dpo` under torchrun (gloo, CPU) at every layout, against one process.

The tiny DPO recipe (LoRA, fp32; the reference is the adapters-off model) on 120 synthetic pairs
in rows of 512 tokens (84 rows; 1024 until 2026-12-07 took 2.5x the time for the same checks), two steps of four rows with validation at step 2: FSDP2 over 2 ranks, expert
parallelism 2 (over the FSDP2-sharded ranks), pipeline parallelism 2 (the last stage scores each pipeline
microbatch's pairs; the reference is a forward-only pass through the pipeline) and context
parallelism 2 (each cp rank's token log-probabilities gathered into the full rows before the
pair sums, each rank carrying 1/cp of the loss) each give the one-process steps: gradient
norm, log-probabilities and the SFT term to relative 1e-5; margin and rewards, differences of
log-probabilities near -200, and the pair loss, a function of the margin, to absolute 2e-5. SimPO (`dpo.reference: none`) with full fine-tuning
under FSDP2 too, and full fine-tuning with the reference model under PP 2 and CP 2 (40 pairs): its
reference log-probabilities, computed before training through the pipeline or gathered over the cp
ranks, are the one-process cache file's (1e-6), and the steps the one-process full fine-tuning run's. Every layout reads the same four rows per step (data-parallel ranks two each;
validation: one batch per data-parallel rank, two in one process: the same four rows). The runs are
`glmtune train` through the CLI's entry point in processes forked with torch and glmtune imported
(tests/distributed/forked_runs.py): the one-process runs in a process of their own, the LoRA and SimPO
layouts one after another on the same two gloo ranks, and each full fine-tuning layout with the
reference model on two ranks of its own (its own data cache: it computes its own reference).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from glmtune.config import DpoConfig, ParallelConfig
from glmtune.data.packing import pack_pairs
from glmtune.data.preferences import tokenize_pair
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.tokenizer import load_tokenizer
from glmtune.distributed.mesh import ParallelMesh
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.parallelize import PipelineOptions, parallelize_glm5
from glmtune.models.glm5.spec import GLM5
from glmtune.train.data_loader import REFERENCE_CACHE, collate
from glmtune.train.preference import PreferenceObjective, pair_counts
from tests.distributed.forked_runs import one_torch_thread, shared_train_runs  # noqa: F401 (autouse: one torch thread)
from tests.distributed.gloo_helpers import run_gloo

RECIPE = "tiny/dpo_support_json"
STEPS = ["--model.name_or_path", "tiny", "--data.synthetic.rows", "120", "--data.packed_sequence_size", "512",
         "--train.max_steps", "2", "--checkpoint.every_steps", "2", "--train.val_every", "2",
         "--train.val_steps", "2"]
DATA_PARALLEL = ["--train.val_steps", "1"]  # one validation batch per rank: the one-process run's two
FULL = ["--peft.method", "none", "--peft.rank", "32", "--peft.alpha", "64"]  # LoRA's settings at their defaults
SIMPO_FULL = [*FULL, "--dpo.reference", "none"]
# The reference pass scores every row once before training: 40 pairs (30 rows of 512) keep it short.
FULL_REFERENCE = [*STEPS, *FULL, "--data.synthetic.rows", "40"]
RELATIVE = ("grad_norm", "dpo/logps_chosen", "dpo/logps_rejected", "dpo/sft_loss", "dpo/accuracy",
            "dpo/pairs", "dpo/chosen_tokens", "val_dpo/logps_chosen", "val_dpo/logps_rejected",
            "val_dpo/sft_loss", "val_dpo/accuracy")
# The pair loss is a function of the margin, so it is held to the margin's bound (measured on an AMD
# EPYC: val_loss 1.2e-5 relative from one process under PP 2 and CP 2, the same before and after 2026-12-04,
# in rows of 1024 tokens).
ABSOLUTE = ("loss", "val_loss", "dpo/margin", "dpo/rewards_chosen", "dpo/rewards_rejected", "val_dpo/margin",
            "val_dpo/rewards_chosen", "val_dpo/rewards_rejected")

LAYOUTS = {
    "fsdp2": DATA_PARALLEL,
    "ep2": ["--parallel.ep", "2", *DATA_PARALLEL],
    "pp2": ["--parallel.pp", "2"],
    "cp2": ["--parallel.cp", "2"],
}


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _assert_same_steps(actual: dict[int, dict], expected: dict[int, dict]) -> None:
    assert sorted(actual) == sorted(expected) == [1, 2]
    for step, want in expected.items():
        got = actual[step]
        for key in (*RELATIVE, *ABSOLUTE):
            if key.startswith("val_") and step != 2:
                continue
            tolerance = dict(rel=1e-5, abs=1e-7) if key in RELATIVE else dict(abs=2e-5)
            assert got[key] == pytest.approx(want[key], **tolerance), (step, key)
    assert expected[2]["dpo/margin"] != 0  # the policy has left its reference: the rewards are compared


# The one-process runs share a data cache: only the full fine-tuning run with the reference model
# writes reference log-probabilities (a LoRA run's reference is its adapters-off forward).
ONE_PROCESS = {"lora": STEPS, "simpo-full": [*STEPS, *SIMPO_FULL], "full-reference": FULL_REFERENCE}
DESCRIBED = {"fsdp2": "dp_shard 2", "ep2": "ep 2", "pp2": "pipeline: 2 stages", "cp2": "cp 2"}


@pytest.fixture(scope="module")
def single(shared_results):
    """The one-process runs (one forked process, no process group: tests/distributed/forked_runs.py)."""
    return shared_train_runs(shared_results, ONE_PROCESS, recipe=RECIPE)


@pytest.fixture(scope="module")
def layouts(shared_results):
    """The LoRA layouts and SimPO under FSDP2, one after another on the same 2 gloo ranks."""
    runs = {**{layout: [*STEPS, *flags] for layout, flags in LAYOUTS.items()},
            "simpo-fsdp2": [*STEPS, *SIMPO_FULL, *DATA_PARALLEL]}
    return shared_train_runs(shared_results, runs, nproc=2, recipe=RECIPE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_dpo_layouts_match_one_process(layout, single, layouts):
    done = layouts[layout]
    described = " ".join(done.stdout.split())  # the console wraps long lines
    assert DESCRIBED[layout] in described
    _assert_same_steps(_records(done.run_dir), _records(single["lora"].run_dir))


def test_reference_free_full_fine_tuning_under_fsdp2_matches_one_process(single, layouts):
    done = layouts["simpo-fsdp2"]
    assert "dp_shard 2" in " ".join(done.stdout.split())
    _assert_same_steps(_records(done.run_dir), _records(single["simpo-full"].run_dir))


def _reference_cache(cache_dir: Path) -> Path:
    (path,) = (cache_dir / "reference_logps").glob("*.safetensors")
    return path


@pytest.mark.parametrize("layout", ["pp2", "cp2"])
def test_full_fine_tuning_with_the_reference_model_under_pp2_and_cp2_matches_one_process(layout, single,
                                                                                       shared_results):
    """The reference log-probabilities computed before training under the layout (through the
    pipeline; gathered over the cp ranks) are the one-process ones, and so are the steps."""
    one = single["full-reference"]
    # its own set of ranks and data cache: the layout computes its own reference
    done = shared_train_runs(shared_results, {layout: [*FULL_REFERENCE, *LAYOUTS[layout]]}, nproc=2,
                             recipe=RECIPE)[layout]
    described = " ".join(done.stdout.split())
    assert DESCRIBED[layout] in described
    assert "computed from the starting weights" in described
    want_path, got_path = _reference_cache(one.cache_dir), _reference_cache(done.cache_dir)
    assert got_path.name == want_path.name  # the same key: the same model and rows
    want, got = load_file(want_path), load_file(got_path)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)
    _assert_same_steps(_records(done.run_dir), _records(one.run_dir))


# -- the reference cache (`ref_token_logps`) under context and pipeline parallelism -------------

def _preference_batch() -> dict:
    """Two packed preference rows of 1024 tokens, with a synthetic reference beside the targets."""
    tokenizer = load_tokenizer(None)
    pairs = [tokenize_pair(row, tokenizer) for row in generate_preference_rows(8, seed=3)]
    rows, _ = pack_pairs(pairs, 1024, pad_token_id=tokenizer.pad_token_id)
    batch = collate(rows[:2])
    noise = torch.rand(batch["targets"].shape, generator=torch.Generator().manual_seed(5))
    batch[REFERENCE_CACHE] = torch.where(batch["targets"] != -100, -1.0 - 4.0 * noise, 0.0)
    return batch


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for name, p in model.named_parameters() if p.grad is not None}


def _cache_under_layout(rank: int, world_size: int, layout: str) -> None:
    """On each rank: the one-process loss and gradients, then the layout's, which must add up to them."""
    batch = _preference_batch()
    objective = PreferenceObjective(DpoConfig(sft_weight=0.5), lora=False)
    totals = pair_counts(batch)
    num_pairs = totals["pairs"]
    denominator = torch.tensor(float(num_pairs))
    single = build_model(get_preset("tiny"), torch.float32, seed=0)
    mb = MicroBatch.of_batch(batch, loss_scale=1.0 / num_pairs, step_totals=totals)
    want_loss, want_pairs, want_stats = GLM5.compute.step_runner(single).train(mb, denominator, objective)
    assert want_stats["margin"] != 0  # the synthetic reference differs from the policy
    model = build_model(get_preset("tiny"), torch.float32, seed=0)
    mesh = ParallelMesh.from_config(ParallelConfig(**{layout: 2}), world_size=world_size)
    options = PipelineOptions("1F1B", 1, microbatches=2, micro_batch=2, seq_len=1024) if layout == "pp" else None
    parallelize_glm5(model, mesh=mesh, pipeline=options)
    runner = GLM5.compute.step_runner(model)
    # the trainer's micro-batch: this rank's targets counted (cp); the runner runs the backward
    mb = MicroBatch.of_batch(batch, runner.local_tokens, loss_scale=1.0 / num_pairs, step_totals=totals)
    loss, pairs, stats = runner.train(mb, denominator, objective)
    if layout == "cp":
        dist.all_reduce(pairs := pairs.clone())  # each cp rank carries 1/cp of the loss and pairs
    else:  # the last stage's rank holds the sums
        for value in [pairs, *stats.values()]:
            dist.all_reduce(value)
    dist.all_reduce(loss := loss.detach().clone())
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=0)
    assert float(pairs) == float(want_pairs) == num_pairs
    for name, value in want_stats.items():
        torch.testing.assert_close(stats[name], value, rtol=1e-5, atol=2e-5, msg=name)
    expected, got = _gradients(single), _gradients(model)
    assert got and set(got) <= set(expected)
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("layout", ["cp", "pp"])
def test_a_cached_reference_under_cp2_and_pp2_adds_up_to_one_process(layout, tmp_path):
    """Full fine-tuning with the reference cache's per-token log-probabilities (synthetic here):
    the cp ranks' loss shares and FSDP2-reduced gradients, or the last stage's loss and each
    stage's gradients, equal the one-process loss and gradients."""
    run_gloo(_cache_under_layout, 2, tmp_path, layout)
