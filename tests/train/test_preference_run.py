"""`train.objective: dpo` end to end: the recipe's refusals, the trainer's preference objective
against the TRL-proven functions of `glmtune/train/preference_loss.py`, the step's mean over pairs
independent of the micro-batch split, and a LoRA run whose reference is the adapters-off model."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest
import torch

from glmtune.config import DpoConfig, validate_config
from glmtune.config.loader import load_config
from glmtune.data.packing import pack_pairs
from glmtune.data.preferences import tokenize_pair
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.tokenizer import load_tokenizer
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.spec import GLM5
from glmtune.peft import apply_lora
from glmtune.peft.lora import adapters_disabled
from glmtune.train.data_loader import collate
from glmtune.models.common.microbatch import MicroBatch
from glmtune.train.preference import PreferenceObjective, pair_counts
from glmtune.train import reference_logps
from glmtune.train.preference_loss import pair_logps, preference_loss, total_loss
from tests.peft.conftest import lora_cfg, randomize_adapters
from tests.train.run_helpers import losses, run_in_fork, start

RECIPE = "recipes/tiny/dpo_support_json.yaml"


def _refusals(*overrides: str) -> str:
    cfg = load_config(RECIPE, ["--model.name_or_path", "tiny", *overrides])
    with pytest.raises(ValueError) as exc:
        validate_config(cfg, num_experts=8, num_layers=4)
    return str(exc.value)


@pytest.mark.parametrize("overrides, said", [
    (["--train.objective", "sft"], "support_preferences makes preference rows"),
    (["--train.objective", "sft", "--dpo.beta", "0.2"], "dpo.beta is set but train.objective is sft"),
    (["--dpo.loss", "ipo", "--dpo.label_smoothing", "0.1"], "IPO's squared loss has no label smoothing"),
    (["--dpo.reference", "none", "--dpo.loss", "robust"], "dpo.reference: none is SimPO"),
    (["--dpo.simpo_gamma", "1.0"], "dpo.simpo_gamma is set but dpo.reference is model"),
    (["--data.too_long", "truncate"], "a cut answer is not the answer that was preferred"),
    (["--data.synthetic.kind", "support_tickets"], "needs preference rows"),
    (["--dpo.beta", "0"], "dpo.beta must be > 0"),
])
def test_settings_a_preference_run_cannot_honour_are_refused(overrides, said):
    assert said in _refusals(*overrides)


def test_the_recipe_validates_and_a_reference_free_full_run_too():
    validate_config(load_config(RECIPE, ["--model.name_or_path", "tiny"]), num_experts=8, num_layers=4)
    cfg = load_config(RECIPE, ["--model.name_or_path", "tiny", "--peft.method", "none", "--peft.rank", "32",
                               "--peft.alpha", "64", "--dpo.reference", "none"])
    validate_config(cfg, num_experts=8, num_layers=4)


@pytest.fixture(scope="module")
def packed_rows():
    tokenizer = load_tokenizer(None)
    pairs = [tokenize_pair(row, tokenizer) for row in generate_preference_rows(8, seed=3)]
    rows, _ = pack_pairs(pairs, 1024, pad_token_id=tokenizer.pad_token_id)
    return rows


@pytest.fixture(scope="module")
def lora_model():
    model = build_model(get_preset("tiny"), seed=0)
    apply_lora(model, lora_cfg())
    randomize_adapters(model)  # policy != reference: the adapters-off model
    return model


def _objective(**dpo) -> PreferenceObjective:
    return PreferenceObjective(DpoConfig(**dpo), lora=True)


def _micro_batch(rows) -> MicroBatch:
    batch = collate(rows)
    return MicroBatch.of_batch(batch, step_totals=pair_counts(batch))


@pytest.mark.parametrize("dpo", [dict(), dict(loss="ipo"), dict(loss="robust", label_smoothing=0.1),
                                 dict(sft_weight=0.5), dict(reference="none", simpo_gamma=0.3)])
def test_the_trainer_objective_is_the_trl_proven_loss(lora_model, packed_rows, dpo):
    """The preference objective run by the model's step runner (its loss / pairs) equals total_loss of
    preference_loss (tests/train/test_preference_loss.py proves those against TRL), the reference
    being the adapters-off model (`prepare`)."""
    mb, objective, runner = _micro_batch(packed_rows), _objective(**dpo), GLM5.compute.step_runner(lora_model)
    loss_sum, pairs, sums = runner.evaluate(objective.prepare(runner, mb), objective)
    logps = lambda: GLM5.compute.token_logps(lora_model, mb)  # noqa: E731
    policy = pair_logps(logps(), mb.targets, mb.document_ids, mb.documents_per_row)
    with torch.no_grad(), adapters_disabled(lora_model):
        ref = pair_logps(logps(), mb.targets, mb.document_ids, mb.documents_per_row)
    free = dpo.get("reference") == "none"
    per_pair, stats = preference_loss(policy["chosen"], policy["rejected"], None if free else ref["chosen"],
                                      None if free else ref["rejected"], chosen_tokens=policy["chosen_tokens"],
                                      rejected_tokens=policy["rejected_tokens"],
                                      **{k: v for k, v in dpo.items() if k != "sft_weight"})
    expected, _ = total_loss(per_pair, policy["chosen"], policy["chosen_tokens"], sft_weight=dpo.get("sft_weight", 0.0))
    assert int(pairs) == mb.step_totals["pairs"] == 8
    torch.testing.assert_close(loss_sum / pairs, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(sums["margin"] / pairs, stats["margin"].mean(), rtol=1e-6, atol=1e-7)
    assert stats["margin"].abs().max() > 0  # the adapters moved the policy away from its reference


def test_adapters_disabled_is_the_model_before_lora():
    base = build_model(get_preset("tiny"), seed=0)
    adapted = build_model(get_preset("tiny"), seed=0)
    apply_lora(adapted, lora_cfg())
    randomize_adapters(adapted)
    ids = torch.randint(1, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        assert not torch.allclose(adapted(ids).logits, before)
        with adapters_disabled(adapted):
            torch.testing.assert_close(adapted(ids).logits, before, rtol=0, atol=0)
        assert not torch.allclose(adapted(ids).logits, before)  # switched back on


def _run_losses(tmp_path, name, *extra):
    result = run_in_fork(tmp_path / name, tmp_path / "cache", "--train.max_steps", "3", "--model.name_or_path",
                         "tiny", "--data.synthetic.rows", "120", "--data.packed_sequence_size", "512",
                         "--train.val_every", "3", "--train.val_steps", "2", "--dpo.sft_weight", "0.3", *extra,
                         recipe=RECIPE)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return result.stdout, records


def test_a_lora_run_logs_pairs_and_its_step_is_the_same_however_the_rows_are_split(tmp_path):
    """Micro-batches of 1 and of 2 rows give the same steps: the loss is a mean over the step's
    pairs and the SFT term over its chosen tokens, not over a micro-batch's."""
    out, split = _run_losses(tmp_path, "micro1", "--train.micro_batch_size", "1")
    _, whole = _run_losses(tmp_path, "micro2", "--train.micro_batch_size", "2")
    for a, b in zip(split, whole):
        assert a["dpo/pairs"] == b["dpo/pairs"] and a["dpo/pairs"] >= 4
        for key in ("loss", "grad_norm", "dpo/logps_chosen", "dpo/logps_rejected", "dpo/accuracy", "dpo/sft_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        # Rewards are beta x (policy - reference) of log-probabilities near -200: micro-batches of other
        # shapes round the forward differently in fp32's last bits (~1e-5 of a sum), which the
        # difference keeps in absolute terms.
        for key in ("dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin"):
            assert a[key] == pytest.approx(b[key], abs=2e-5), key
    first = split[0]
    assert first["dpo/margin"] == 0 and first["dpo/rewards_chosen"] == 0  # B = 0: the policy is the reference
    assert split[-1]["dpo/margin"] != 0 and "val_dpo/accuracy" in split[-1]
    assert "preference accuracy" in out and "preference pairs" in out


# The reference pass scores every row once before training: 40 pairs (30 rows of 512 tokens, the
# four steps' 16 among them) keep it short.
FULL = ["--model.name_or_path", "tiny", "--peft.method", "none", "--peft.rank", "32", "--peft.alpha", "64",
        "--data.packed_sequence_size", "512", "--data.synthetic.rows", "40", "--train.max_steps", "4"]


def test_full_fine_tuning_reference_is_cached_and_a_killed_run_resumes_without_recomputing_it(tmp_path):
    """The reference log-probabilities are computed once from the starting weights; a run killed with
    SIGKILL and resumed reads them back (the file untouched) and gives the uninterrupted losses."""
    straight = run_in_fork(tmp_path / "straight", tmp_path / "cache-a", *FULL, recipe="tiny/dpo_support_json")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    assert "computed from the starting weights" in straight.stdout
    expected = losses(tmp_path / "straight")
    assert sorted(expected) == list(range(1, 5)) and expected[1] == pytest.approx(math.log(2), abs=1e-6)

    killed_dir, cache = tmp_path / "killed", tmp_path / "cache-b"
    proc = start(killed_dir, cache, *FULL, recipe="tiny/dpo_support_json")
    ckpt = killed_dir / "checkpoints" / "step-00000002"
    deadline = time.monotonic() + 300
    while not (ckpt / "checksums.json").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, output
    (cached,) = (cache / "reference_logps").glob("*.safetensors")
    written = cached.stat().st_mtime_ns

    resumed = run_in_fork(killed_dir, cache, *FULL, "--checkpoint.resume", "auto", recipe="tiny/dpo_support_json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = resumed.stdout.replace("\n", "")  # rich wraps long lines
    assert f"reused from the cache, key {cached.stem}" in " ".join(resumed.stdout.split())
    assert cached.name in said and "computed from" not in said
    assert cached.stat().st_mtime_ns == written
    assert losses(killed_dir) == expected  # the same floats at every step


def test_a_reference_cache_that_does_not_match_the_rows_is_refused_not_used(tmp_path, packed_rows):
    values = [torch.randn(sum(t != -100 for t in row["labels"][1:])) for row in packed_rows]
    path = tmp_path / "ref.safetensors"
    reference_logps.save(path, values, [], {"rows": len(values)})
    train, val = reference_logps.load(path, packed_rows, [])
    assert all(torch.equal(a, b) for a, b in zip(train, values)) and val == []
    with pytest.raises(ValueError, match="do not match this run's train rows"):
        reference_logps.load(path, packed_rows[1:], [])
