"""AdamW over fp32 master weights held by the optimizer for bf16 parameters.

The layers compute with the bf16 parameters themselves (no per-step cast, no FSDP2 mixed
precision), but an update of lr 1e-5 rounds away on most bf16 weights (`precision.py`). So
the optimizer keeps, per trainable bf16 parameter, an fp32 master copy beside torch AdamW's
two moments (fp32 whatever the parameter's dtype). A step updates master and moments from
the bf16 gradient and writes the master, rounded, into the parameter:

    bytes per parameter  2 (bf16 weight) + 2 (bf16 gradient) + 4 (master) + 8 (moments) = 16

Under FSDP2 the master of a DTensor parameter is a DTensor with its placements: each rank
holds the master of its own shard, and the update touches local shards only. fp32
parameters (the routers) are their own masters.

Backends: `triton` (one bandwidth-bound kernel per tensor, `glmtune/kernels/adamw.py`) and
`torch` (the reference the kernel is tested against: torch's single-tensor AdamW arithmetic
on the master, any device).

The loop over the parameters is `PerTensorAdamW`'s, which `glmtune.train.optim.TritonAdamW`
shares: torch AdamW's per-parameter state, made at a parameter's first gradient, and one
in-place update per tensor, the subclass's (`_update`).

The state dict is torch AdamW's (`step`, `exp_avg`, `exp_avg_sq`; moments kept fp32, which
torch's `load_state_dict` would cast to the parameter's dtype). The masters are not in it: a
checkpoint stores them in place of the parameters (`with_masters`), so its layout is that of
fp32 parameters with fp32 AdamW state. Checkpoints of the earlier fp32-parameter path have
exactly that layout and resume here unchanged.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any

import torch

from glmtune.kernels.adamw import adamw_master_step_, adamw_step_

BACKENDS = ("triton", "torch")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (FSDP2 parameters are DTensors)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _identity(tensor: torch.Tensor) -> tuple:
    """What a state dict's view of a parameter shares with it: local storage, global shape and
    placement (an empty local shard has no storage of its own; shape and placement tell it)."""
    return _local(tensor).data_ptr(), tuple(tensor.shape), str(getattr(tensor, "placements", ""))


def reference_master_step_(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                           eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's single-tensor update of `master` (fp32) from `grad`; `param` gets the
    rounded master (nothing when `param` is its own master)."""
    g = grad.to(torch.float32)
    master.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / (1.0 - beta1**step))
    if param is not master:
        param.copy_(master)


class PerTensorAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's loop and state layout (a CPU step counter, `exp_avg` and `exp_avg_sq`
    in `moment_dtype`, None: the parameter's), each parameter with a gradient updated in place by
    `_update`, on this rank's shards; `MasterAdamW` and `glmtune.train.optim.TritonAdamW`."""

    moment_dtype: torch.dtype | None = None

    def _update(self, param: torch.Tensor, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
        """One AdamW update of `param`, given as local shards: `p` of it, `g` of its gradient, `m`
        and `v` of its moments; `step` counts from 1."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:  # as torch.optim.AdamW lays it out: a CPU step counter, then the moments
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.moment_dtype)
                state["step"] += 1
                self._update(param, _local(param), _local(param.grad), _local(state["exp_avg"]),
                             _local(state["exp_avg_sq"]), step=int(state["step"].item()), **hyper)
        return loss


class MasterAdamW(PerTensorAdamW):
    """AdamW (decoupled weight decay, torch's defaults) over fp32 masters of the low-precision
    parameters it is given; no amsgrad, maximize or differentiable mode."""

    moment_dtype = torch.float32  # whatever the parameter's dtype

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, backend: str = "torch") -> None:
        assert backend in BACKENDS, backend
        # torch.optim.AdamW's group keys, all of them: DCP loads a checkpoint strictly by our keys,
        # and either optimizer resumes the other's checkpoint
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=True)
        super().__init__(params, defaults)
        self.backend = backend
        # Made now, not at the first step: a resumed run loads the checkpoint into them.
        self.masters: dict[torch.Tensor, torch.Tensor] = {
            p: p.detach().to(torch.float32) for group in self.param_groups for p in group["params"]
            if p.dtype != torch.float32}

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 tensor AdamW updates for `param` (the parameter itself when it is fp32)."""
        return self.masters.get(param, param)

    def _update(self, param: torch.Tensor, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
                step: int, **hyper: float) -> None:
        if param in self.masters:
            update = adamw_master_step_ if self.backend == "triton" else reference_master_step_
            update(p, g, _local(self.masters[param]), m, v, step=step, **hyper)
        elif self.backend == "triton":  # an fp32 parameter is its own master
            adamw_step_(p, g, m, v, step=step, **hyper)
        else:
            reference_master_step_(p, g, p, m, v, step=step, **hyper)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that the moments stay fp32 (torch casts them to the parameter's dtype)."""
        moments = {key: {name: value for name, value in entry.items() if name in ("exp_avg", "exp_avg_sq")}
                   for key, entry in state_dict["state"].items()}
        steps_only = {key: {name: value for name, value in entry.items() if name not in moments[key]}
                      for key, entry in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": steps_only})
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for key, param in zip(saved_ids, params):
            for name, value in moments.get(key, {}).items():
                self.state[param][name] = value.to(dtype=torch.float32, device=param.device)

    def with_masters(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """`model_state` (a model state dict whose tensors are views of the parameters) with each
        parameter that has a master replaced by the master: what a checkpoint saves and loads into."""
        by_identity = {_identity(param): master for param, master in self.masters.items()}
        out, found = {}, set()
        for name, value in model_state.items():
            master = by_identity.get(_identity(value)) if isinstance(value, torch.Tensor) else None
            if master is not None:
                found.add(id(master))
            out[name] = value if master is None else master
        assert len(found) == len(self.masters), (
            f"{len(self.masters) - len(found)} fp32 masters have no entry in the model state dict")
        return out
