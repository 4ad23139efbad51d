"""A pipeline stage whose FSDP2 gradient reduce-scatters run during its last backward.

torch's `PipelineStage` runs every backward of an FSDP2-wrapped stage with gradient sync off and
reduces the stage's gradients only after its last microbatch's backward has ended (the schedule's
REDUCE_GRAD action, or the end of that backward in older torch): every layer's reduce-scatter is
issued at once there, and the stage's finalization makes the compute stream wait for all of them.
Nothing computes beside them. Measured with emulated links on sft_4k's rank 0 (40 layers, one H100,
docs/benchmarks.md 2026-12-08): the FSDP lane held 0.61 s of a 4.0 s step, 23% of it beside
compute, and the REDUCE_GRAD actions waited 0.27 s for it.

`ReducingStage` turns gradient sync on for the stage's last backward only, before autograd runs, so
FSDP2's own post-backward hooks reduce-scatter each layer's accumulated gradient as soon as that
layer's backward is done, while the layers below it still compute (as FSDP2 does without a
pipeline). The earlier microbatches' backwards still accumulate without sync. The values are the
same: each FSDP unit reduce-scatters the same accumulated gradient in the same collective, only
issued earlier (tests/distributed/test_pipeline_train.py and the other layout tests equal one
process; tests/distributed/test_pipeline_stage.py: where the reduce-scatters are issued).

What is left to REDUCE_GRAD (torch 2.9 and later) finds every gradient reduced: its post-backward
calls have nothing to send. The last backward ends with FSDP2's own finalization
(`set_is_last_backward(True)`): the compute stream waits for the reduce-scatters still in flight,
before anything later reads the sharded gradients.

Only a whole backward is affected. A zero-bubble schedule's input half (an I action) is never the
last backward: its weight half is, and is left to torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward


class ReducingStage(PipelineStage):
    """`PipelineStage` whose FSDP2 module reduce-scatters during its last whole backward (module
    docstring); any other stage, or backward, is torch's."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
                                   ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if not (last_backward and backward_type == "full" and isinstance(self.submod, FSDPModule)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        self.submod.set_is_last_backward(True)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None
