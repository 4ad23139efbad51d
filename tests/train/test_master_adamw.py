"""`MasterAdamW`'s torch reference against torch.optim.AdamW over fp32 weights, its state dict
against torch AdamW's, and its checkpoints: the masters in the parameters' place, and a
checkpoint of fp32 parameters with torch AdamW (the earlier fp32-master path) resumed exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from glmtune.checkpoint.manager import CheckpointManager
from glmtune.train.master_adamw import MasterAdamW
from glmtune.train.optim import build_optimizer, master_backend

HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)


def _fp32_weights(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 0.02 for shape in ((37, 53), (4099,), (3, 5, 7))]


def _groups(params):
    return [{"params": params[:1] + params[2:], "weight_decay": 0.1}, {"params": params[1:2], "weight_decay": 0.0}]


def _bf16_grads(params, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in params]


def _step(optimizer, params, grads) -> None:
    for param, grad in zip(params, grads):
        param.grad = grad.to(param.dtype)
    optimizer.step()


def test_masters_follow_torch_adamw_over_fp32_weights_and_the_bf16_weights_are_their_rounding():
    start = _fp32_weights(0)
    ours = [w.to(torch.bfloat16).requires_grad_() for w in start]
    reference = [w.to(torch.bfloat16).float().requires_grad_() for w in start]  # the same start, in fp32
    opt = MasterAdamW(_groups(ours), **HYPER)
    ref_opt = torch.optim.AdamW(_groups(reference), foreach=False, **HYPER)
    for seed in range(3):
        grads = _bf16_grads(ours, seed)
        _step(opt, ours, grads)
        _step(ref_opt, reference, grads)  # the same bf16 gradient values, read in fp32
    for param, ref in zip(ours, reference):
        assert param.dtype == torch.bfloat16
        assert torch.equal(opt.master_of(param), ref.detach())  # the same single-tensor arithmetic
        assert torch.equal(param.detach(), ref.detach().to(torch.bfloat16))
        state = opt.state[param]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(state["exp_avg"], ref_opt.state[ref]["exp_avg"])


def test_an_fp32_parameter_is_its_own_master():
    router = torch.nn.Parameter(torch.randn(8, 4))
    weight = torch.nn.Parameter(torch.randn(8, 4).to(torch.bfloat16))
    opt = MasterAdamW([router, weight], lr=1e-2)
    assert list(opt.masters) == [weight] and opt.master_of(router) is router
    reference = torch.nn.Parameter(router.detach().clone())
    ref_opt = torch.optim.AdamW([reference], lr=1e-2, foreach=False)
    for grad in (torch.randn(8, 4), torch.randn(8, 4)):
        router.grad, weight.grad, reference.grad = grad, grad.to(torch.bfloat16), grad
        opt.step()
        ref_opt.step()
    assert torch.equal(router.detach(), reference.detach())


def test_state_dicts_resume_either_way_and_keep_the_moments_fp32():
    start = _fp32_weights(1)
    ours = [w.to(torch.bfloat16).requires_grad_() for w in start]
    opt = MasterAdamW(_groups(ours), **HYPER)
    _step(opt, ours, _bf16_grads(ours, 0))
    # torch AdamW over fp32 weights picks up our state (its keys are ours) and continues as we do
    theirs = [opt.master_of(p).clone().requires_grad_() for p in ours]
    their_opt = torch.optim.AdamW(_groups(theirs), foreach=False, **HYPER)
    their_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    # and a fresh MasterAdamW picks up theirs: torch would cast the moments to bf16, ours keeps fp32
    back = [p.detach().clone().requires_grad_() for p in ours]
    back_opt = MasterAdamW(_groups(back), **HYPER)
    for param, master in zip(back, ours):
        back_opt.master_of(param).copy_(opt.master_of(master))
    back_opt.load_state_dict(copy.deepcopy(their_opt.state_dict()))
    assert {v.dtype for s in back_opt.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    grads = _bf16_grads(ours, 1)
    for o, params in ((opt, ours), (their_opt, theirs), (back_opt, back)):
        _step(o, params, grads)
    for a, b, c in zip(ours, theirs, back):
        assert torch.equal(opt.master_of(a), b.detach())
        assert torch.equal(back_opt.master_of(c), b.detach())


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    return model.to(dtype)


def _train(model, optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _master_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "auto", masters=True)


def _resume_with_masters(tmp_path, model, optimizer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint of `model` and `optimizer` at step 3, loaded into a fresh bf16 model and its
    `MasterAdamW`: the two returned."""
    CheckpointManager(tmp_path / "ckpt").save(3, model, optimizer, {})
    resumed = _model(torch.bfloat16)
    resumed_opt = _master_optimizer(resumed)
    manager = CheckpointManager(tmp_path / "ckpt")
    manager.load(manager.latest(), resumed, resumed_opt)
    return resumed, resumed_opt


def test_a_checkpoint_holds_the_masters_and_resumes_them_exactly(tmp_path):
    model = _model(torch.bfloat16)
    opt = _master_optimizer(model)
    _train(model, opt, 3, seed=0)
    resumed, resumed_opt = _resume_with_masters(tmp_path, model, opt)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(opt.master_of(a), resumed_opt.master_of(b))
        assert torch.equal(a, b)
        assert not torch.equal(resumed_opt.master_of(b), b.float())  # the masters, not their bf16 copies
    _train(model, opt, 2, seed=1)
    _train(resumed, resumed_opt, 2, seed=1)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(opt.master_of(a), resumed_opt.master_of(b))


def test_a_checkpoint_of_fp32_parameters_with_torch_adamw_resumes_as_the_masters(tmp_path):
    """The layout the fp32-master path wrote before the masters moved into the optimizer."""
    old = _model(torch.float32)
    old_opt = build_optimizer(old, 1e-3, 0.0, (0.9, 0.999), 1e-8, "auto")  # torch's AdamW, as that path built it
    assert type(old_opt) is torch.optim.AdamW
    _train(old, old_opt, 3, seed=0)
    new, new_opt = _resume_with_masters(tmp_path, old, old_opt)
    for before, param in zip(old.parameters(), new.parameters()):
        assert torch.equal(new_opt.master_of(param), before.detach())
        assert torch.equal(param.detach(), before.detach().to(torch.bfloat16))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new_opt.state[param][key], old_opt.state[before][key])
    # the same next update from the same gradient: the masters continue the fp32 weights
    for before, param in zip(old.parameters(), new.parameters()):
        grad = torch.randn(before.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        before.grad, param.grad = grad.float(), grad
    old_opt.step()
    new_opt.step()
    for before, param in zip(old.parameters(), new.parameters()):
        torch.testing.assert_close(new_opt.master_of(param), before.detach(), rtol=1e-6, atol=1e-9)


def test_the_backend_follows_optim_fused():
    cpu = [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    assert master_backend("auto", cpu) == "torch" and master_backend(False, cpu) == "torch"
    with pytest.raises(ValueError, match="optim.fused: true is torch's fused AdamW"):
        master_backend(True, cpu)
    with pytest.raises(ValueError, match="optim.fused: triton needs"):
        master_backend("triton", cpu)


def test_a_master_missing_from_the_model_state_is_an_error():
    weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = MasterAdamW([weight])
    with pytest.raises(AssertionError, match="1 fp32 masters have no entry"):
        opt.with_masters({"other": torch.zeros(4)})
