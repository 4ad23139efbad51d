"""`HF_FORMAT`: how an `hf` family model is stored as an HF directory, for glmtune/checkpoint/.

checkpoint/'s HF verifier (`glmtune inspect --verify`, hf_verify.py) knows no family
(models/common/hf_format.py); the spec hands it this: config.json read by `HfArgs.from_hf_config`,
the names by `HfStateDictAdapter` (transformers' own, a MoE model's experts per expert), the model on meta by
transformers' own class. The family loads and saves through transformers itself (spec.py).
"""

from __future__ import annotations

import torch
from torch import nn

from glmtune.models.common.hf_format import HfFormat
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.model import build_model
from glmtune.models.hf.state_dict_adapter import HfStateDictAdapter


def build_meta(args: HfArgs, dtype: torch.dtype) -> nn.Module:
    """transformers' model of `args` on the meta device, in `dtype`."""
    return build_model(args, dtype, device="meta")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in (transformers' `PreTrainedModel.dtype`)."""
    return model.dtype


HF_FORMAT = HfFormat(
    read_config=HfArgs.from_hf_config,
    adapter=HfStateDictAdapter,
    build_meta=build_meta,
    hf_config=HfArgs.to_hf_dict,
    model_dtype=model_dtype,
)
