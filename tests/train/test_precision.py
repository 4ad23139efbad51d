"""Parameter and compute dtypes (`train.master_weights`), the bf16 rounding estimate behind
the bf16-only warning, and the gradient norm the trainer clips with."""

from __future__ import annotations


import pytest
import torch

from glmtune.config import load_config
from glmtune.models.glm5 import build_model, get_preset
from glmtune.train.precision import bf16_rounded_away, resolve_precision, rounding_threshold
from glmtune.train.trainer import clip_grad_norm_
from tests.train.run_helpers import run
from tests.tree_snapshot import changes, snapshot


def _precision(*overrides: str):
    return resolve_precision(load_config(None, list(overrides)))


def test_bf16_full_fine_tuning_gets_fp32_master_weights_by_default():
    default = _precision("--model.dtype", "bfloat16")
    assert (default.param_dtype, default.compute_dtype, default.masters) == (torch.bfloat16, torch.bfloat16, True)
    assert default.describe() == "bf16 parameters and compute, fp32 master weights in the optimizer"
    bf16_only = _precision("--model.dtype", "bfloat16", "--train.master_weights", "none")
    assert (bf16_only.param_dtype, bf16_only.masters) == (torch.bfloat16, False)
    fp32 = _precision("--model.dtype", "float32")  # the tiny recipes: fp32 throughout, nothing to hold
    assert (fp32.param_dtype, fp32.masters) == (torch.float32, False)
    fp32_masters = _precision("--model.dtype", "float32", "--train.master_weights", "fp32")
    assert fp32_masters.masters is False  # fp32 parameters are their own masters
    lora = _precision("--model.dtype", "bfloat16", "--peft.method", "lora")  # adapters are fp32 already
    assert (lora.param_dtype, lora.masters) == (torch.bfloat16, False)


@pytest.mark.parametrize("overrides, keys", [
    (["--peft.method", "lora", "--train.master_weights", "fp32"], ["train.master_weights: fp32", "peft.method: lora"]),
    (["--model.dtype", "bfloat16", "--optim.fused", "true"], ["optim.fused: true", "train.master_weights: auto"]),
])
def test_combinations_that_cannot_work_are_refused_naming_the_keys(overrides, keys):
    with pytest.raises(ValueError) as error:
        _precision(*overrides)
    for key in keys:
        assert key in str(error.value)


def test_glmtune_train_refuses_them_before_writing_anything(tmp_path):
    before = snapshot(tmp_path)
    result = run(tmp_path / "run", tmp_path / "cache", "--peft.method", "lora", "--train.master_weights", "fp32")
    assert result.returncode != 0
    assert "train.master_weights: fp32 with peft.method: lora" in result.stderr + result.stdout
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("lr", [1e-5, 3e-5, 2e-4, 1e-3])
def test_rounding_threshold_is_exact_for_every_bf16_value(lr):
    # Every positive normal bf16 value: an update of lr away from zero changes it iff |w| < T.
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32).to(torch.int16)
    w = bits.view(torch.bfloat16)
    moved = (w.float() + lr).to(torch.bfloat16) != w
    threshold = rounding_threshold(lr)
    assert torch.equal(moved, w.float() < threshold)
    # Towards zero too, except at the bottom of a binade (the spacing below is half as wide).
    inside = (w.float() >= threshold) & (bits & 0x7F != 0)
    assert not ((w.float() - lr).to(torch.bfloat16) != w)[inside].any()


def test_rounded_away_share_counts_trainable_bf16_weights_only():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, std=0.02)
    # |w| >= 2^-8 for lr 1e-5: P(|N(0, 0.02)| >= 0.0039) = 0.845, the "85% unchanged".
    assert bf16_rounded_away(linear, 1e-5) == pytest.approx(0.845, abs=0.005)
    model = build_model(get_preset("tiny"), torch.bfloat16, seed=0)
    share = bf16_rounded_away(model, 1e-5)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and 0.8 < share < 0.95  # MTP and indexers are frozen and not counted
    for param in model.parameters():
        param.requires_grad_(param.dtype != torch.bfloat16)  # only the fp32 routers train
    assert bf16_rounded_away(model, 1e-5) is None
    assert bf16_rounded_away(build_model(get_preset("tiny"), torch.float32, seed=0), 1e-5) is None


def test_grad_norm_is_the_exact_global_norm_and_clips_to_max():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (524288, 1000, 1)]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-2
    exact = sum(float(p.grad.double().square().sum()) for p in params) ** 0.5
    grads = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=0.5)
    assert float(norm) == pytest.approx(exact, rel=1e-12)  # torch.nn.utils.get_total_norm: 5e-6 off here on CPU
    for param, grad in zip(params, grads):
        torch.testing.assert_close(param.grad, grad * (0.5 / (exact + 1e-6)))
    assert float(clip_grad_norm_(params, max_norm=float("inf"))) == pytest.approx(0.5, rel=1e-6)
