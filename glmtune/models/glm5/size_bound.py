"""How many parameters a GLM-5 config.json may describe when glmtune takes it on its word.

A config.json read with no weights beside it (`glmtune config validate` or `glmtune plan` on a
downloaded config, a recipe's placeholder) has nothing to check its sizes against, and every
size it gives is a number someone typed: `vocab_size: 10**12` describes a 6-quadrillion-
parameter model that a plan would size memory for. `check_parameter_count` refuses a config
describing more than `MAX_PARAMETERS`: 10^13, about 13 times GLM-5's 7.5 * 10^11 (20 TB of
bf16 weights: beyond any machine glmtune plans for, while leaving room for larger releases),
and first one with a tensor of more than 2^63 bytes in fp32 (`hidden_size: 10**12`: no machine
addresses it; torch refuses to create it even on the meta device).
A config that comes with weights is checked against them instead (checkpoint/hf_verify.py).

The count is param_count.py's closed form: torch-free, and exact at any depth without building
anything (a 10,000-layer config costs what a 2-layer one does).
"""

from __future__ import annotations

from pathlib import Path

from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.param_count import largest_tensor, parameter_count

MAX_PARAMETERS = 10**13
_MAX_TENSOR_BYTES = 2**63 - 1  # torch's storage size is an int64 of bytes
_FP32_BYTES = 4  # the dtype a model is built in by default (the router weight always)


def check_parameter_count(args: Glm5Args, config: str | Path) -> None:
    """ValueError naming `config` when it describes more than `MAX_PARAMETERS` parameters, or
    sizes no machine holds (a config.json with no weights to check it against)."""
    largest = largest_tensor(args)
    if largest * _FP32_BYTES > _MAX_TENSOR_BYTES:
        raise ValueError(f"{config}: its sizes describe a tensor no machine holds ({largest:,} elements, more than "
                         f"2^63 bytes)")
    count = parameter_count(args)
    if count > MAX_PARAMETERS:
        raise ValueError(f"{config}: describes a model of {count:,} parameters, more than the {MAX_PARAMETERS:,} "
                         "glmtune takes from a config.json with no weights to check it against (GLM-5 has "
                         "7.5 * 10^11); check its sizes (vocab_size, hidden_size, n_routed_experts, ...)")
