"""glmtune's Triton AdamW against torch.optim.AdamW: same updates over several steps
(decay and no-decay groups, odd sizes), and state dicts either optimizer can resume.

The kernel runs in Triton's CPU interpreter (switched on before triton is imported, so
in a child process) with fp32 tensors; bf16 on GPU is checked by benchmarks/adamw.py.
"""

import copy
import os

import pytest
import torch
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def _params(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in ((37, 53), (4099,), (3, 5, 7))]


def _groups(params):
    return [{"params": params[:1] + params[2:], "weight_decay": 0.1}, {"params": params[1:2], "weight_decay": 0.0}]


def _run(optimizer, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        optimizer.step()


def check_matches_torch_adamw():
    from glmtune.train.optim import TritonAdamW

    hyper = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6)
    ours, reference = _params(0), _params(0)
    ours_opt = TritonAdamW(_groups(ours), **hyper)
    ref_opt = torch.optim.AdamW(_groups(reference), foreach=False, **hyper)
    _run(ours_opt, ours, 3, seed=1)
    _run(ref_opt, reference, 3, seed=1)
    for a, b, start in zip(ours, reference, _params(0)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - start).abs().mean() > 1e-3  # it moved (lr 3e-3, 3 steps)
    # torch AdamW resumes from our state dict (and the reverse) and continues identically
    resumed = [p.detach().clone().requires_grad_() for p in ours]
    resumed_opt = torch.optim.AdamW(_groups(resumed), foreach=False, **hyper)
    resumed_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))  # load_state_dict shares tensors
    back = [p.detach().clone().requires_grad_() for p in reference]
    back_opt = TritonAdamW(_groups(back), **hyper)
    back_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for opt, params in ((ours_opt, ours), (resumed_opt, resumed), (back_opt, back)):
        _run(opt, params, 2, seed=2)
    for a, b, c in zip(ours, resumed, back):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-7)


def check_fsdp2_sharded_parameters():
    """FSDP2 parameters are DTensors: the kernel updates each rank's local shard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from glmtune.train.optim import TritonAdamW

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 8))
            fully_shard(model, mesh=mesh)
            models.append(model)
        ours = TritonAdamW(models[0].parameters(), lr=1e-2)
        reference = torch.optim.AdamW(models[1].parameters(), lr=1e-2, foreach=False)
        x = torch.randn(5, 24)
        for model, opt in ((models[0], ours), (models[1], reference)):
            for _ in range(2):
                model(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert type(a).__name__ == "DTensor"
            torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-6, atol=1e-7)
    finally:
        dist.destroy_process_group()


def check_master_kernel_matches_its_reference():
    """MasterAdamW's kernel against its torch reference (fp16 parameters: the interpreter has no
    bf16), an fp32 parameter among them (its own master), over 3 steps."""
    from glmtune.train.master_adamw import MasterAdamW

    sides = []
    for backend in ("triton", "torch"):
        params = [p.detach().to(torch.float16).requires_grad_() for p in _params(0)]
        params.append(torch.randn(11, 7, generator=torch.Generator().manual_seed(5)).requires_grad_())
        opt = MasterAdamW(_groups(params[:3]) + [{"params": params[3:], "weight_decay": 0.1}], backend=backend,
                          lr=3e-3, betas=(0.8, 0.95), eps=1e-6)
        _run(opt, params, 3, seed=1)
        sides.append((params, opt))
    (ours, ours_opt), (reference, ref_opt) = sides
    for a, b in zip(ours, reference):
        torch.testing.assert_close(ours_opt.master_of(a), ref_opt.master_of(b), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours_opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"], rtol=1e-6,
                                   atol=1e-9)
        assert torch.equal(a.detach(), ours_opt.master_of(a).to(a.dtype))  # the weight is the rounded master
    assert len(ours_opt.masters) == 3


def test_triton_adamw_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_matches_torch_adamw", "check_fsdp2_sharded_parameters",
                                                   "check_master_kernel_matches_its_reference"]


if __name__ == "__main__":
    main(check_matches_torch_adamw, check_fsdp2_sharded_parameters, check_master_kernel_matches_its_reference)
