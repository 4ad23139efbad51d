"""`GLM5_HF_FORMAT`: how GLM-5 checkpoints are stored as HF directories, for glmtune/checkpoint/.

checkpoint/'s HF readers, verifier and writers know no family (models/common/hf_format.py); the
spec hands them this: config.json read by `Glm5Args.from_hf_config` (no size bound: the weights
beside it are what it is checked against), the names by `Glm5StateDictAdapter` (per-expert keys,
MTP layers after the decoder layers, a tied head not stored, the routers' bias in F32), the model
on meta by `build_model`, and config.json written by `Glm5Args.to_hf_dict` in the dtype of the
embedding (the routers stay fp32 whatever the model computes in).
"""

from __future__ import annotations

import torch

from glmtune.models.common.hf_format import HfFormat
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import Glm5ForCausalLM, build_model
from glmtune.models.glm5.state_dict_adapter import Glm5StateDictAdapter


def build_meta(args: Glm5Args, dtype: torch.dtype) -> Glm5ForCausalLM:
    """The model of `args` on the meta device, in `dtype` (its routers fp32), as the loader builds it."""
    return build_model(args, dtype, device="meta")


def model_dtype(model: Glm5ForCausalLM) -> torch.dtype:
    """The dtype the model computes in: its embedding's (the routers are fp32 in any model)."""
    return model.model.embed_tokens.weight.dtype


GLM5_HF_FORMAT = HfFormat(
    read_config=Glm5Args.from_hf_config,
    adapter=Glm5StateDictAdapter,
    build_meta=build_meta,
    hf_config=Glm5Args.to_hf_dict,
    model_dtype=model_dtype,
)
