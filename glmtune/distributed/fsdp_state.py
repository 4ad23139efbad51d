"""Keep FSDP2's unsharded parameters from outliving the step that gathered them.

FSDP2 does not reshard the root unit after a forward (its parameters are needed again
at once in backward). A forward outside a training step — greedy generation, a
validation pass — therefore leaves the root's gathered copies (embedding, final norm,
head) registered on the module, and the next training step may skip the all-gather
and train on copies that the optimizer step after it does not update: measured on 2
ranks, a hidden-states forward before training changed step 2's loss by 3e-4
relative. `release_gathered(model)` reshards every unit after such a forward; it is a
no-op for a model that FSDP2 does not wrap.
"""

from __future__ import annotations

from torch import nn


def release_gathered(model: nn.Module) -> None:
    """Reshard every FSDP2 unit of `model` (root included) after a non-training forward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
