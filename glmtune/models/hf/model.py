"""An `hf` family model: transformers' own causal-LM class, built from `HfArgs`, run on packed rows.

`build_model` makes the class config.json names (`AutoModelForCausalLM.from_config`, so the
modules and parameter names are transformers' own) on any device, "meta" included.

`final_hidden` runs the decoder (the model without its LM head) over a packed batch. Packed
documents must not attend across each other: the document ids become an attention mask through
transformers' own mask builders (`create_causal_mask` / `create_sliding_window_causal_mask`
with `packed_sequence_mask_function` as an extra condition), in the form the model's attention
implementation takes (a boolean tensor for SDPA, an additive one for eager, a block mask for
flex). The prepared mask goes in as the model's `attention_mask`, which transformers' models
take as it is. A batch known to hold one document per row (`single_document`) keeps the plain
causal path.

`loss_sum` and `token_logps` apply glmtune's chunked loss (models/common/loss.py) to the final
hidden states of a `MicroBatch` (models/common/microbatch.py) and the LM head's weight: no
[tokens, vocab] logits are materialized. Under FSDP2 they run as a forward method of the root unit (`FSDP_RUN`), which gathers its parameters.
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    packed_sequence_mask_function,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from glmtune.models.common.loss import chunked_cross_entropy, chunked_token_logps
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.hf.args import HfArgs

LOSS_CHUNK_SIZE = 2048
# The loss runs the decoder and reads the LM head's weight outside the model's own `forward`, so
# under FSDP2 the root unit (embedding, final norm, head) must gather its parameters around it as
# around a forward: parallelize.py sets this attribute (`call_on` bound to the model) and registers
# it as one of the root's forward methods (`register_fsdp_forward_method`).
FSDP_RUN = "glmtune_fsdp_run"


def transformers_config(args: HfArgs) -> PretrainedConfig:
    """transformers' configuration object of `args` (its whole config.json)."""
    values = {key: value for key, value in args.config.items() if key != "model_type"}
    try:
        return AutoConfig.for_model(args.model_type, **values)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:  # unknown, or refused by its validators
        if args.model_type not in CONFIG_MAPPING:
            raise ValueError(f"model_type {args.model_type!r}: transformers {transformers.__version__} does not "
                             "implement it") from None
        raise ValueError(f"config.json: transformers refuses it as a {args.model_type} config: "
                         f"{str(exc).splitlines()[0]}") from None


def build_model(args: HfArgs, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int | None = None, init: bool = True) -> nn.Module:
    """transformers' causal LM of `args` in `dtype` on `device` ("meta": no storage). `init`:
    transformers' random initialization (from `seed` when given); without it the storage is
    left as allocated, for a load to fill."""
    config = transformers_config(args)
    if str(device) != "meta" and not init:
        model = build_model(args, dtype, "meta")
        return model.to_empty(device=device)
    rng = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng, torch.device(device):
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_model(model, args)
    return model


def check_model(model: nn.Module, args: HfArgs) -> None:
    """What glmtune's loss and parallelization need of the built class, refused in one sentence."""
    name = type(model).__name__
    if name != args.architecture:
        raise ValueError(f"config.json names {args.architecture}, but transformers builds {name} for model_type "
                         f"{args.model_type!r}")
    head = model.get_output_embeddings()
    plain_head = isinstance(head, nn.Linear) and head.bias is None
    if not plain_head:
        raise ValueError(f"{name}: the LM head is not a bias-free linear layer, which glmtune's fused loss needs")
    has_layers = isinstance(getattr(model.get_decoder(), "layers", None), nn.ModuleList)
    if not has_layers:
        raise ValueError(f"{name}: its decoder keeps no `layers` list, which glmtune's parallelization wraps")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_decoder().layers


def document_mask(config: PretrainedConfig, input_ids_BS: torch.Tensor, document_ids_BS: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor | dict:
    """The block-causal attention mask of packed rows (module docstring), as transformers' builders
    give it for `config`'s attention implementation; a {layer type: mask} mapping when the model
    mixes full and sliding-window layers."""
    shape_only_BS0 = torch.empty(*input_ids_BS.shape, 0, dtype=dtype, device=input_ids_BS.device)
    same_document = packed_sequence_mask_function(document_ids_BS)
    kwargs = {"config": config, "inputs_embeds": shape_only_BS0, "attention_mask": None, "cache": None,
                  "and_mask_function": same_document}
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types:
        return {"full_attention": create_causal_mask(**kwargs),
                "sliding_attention": create_sliding_window_causal_mask(**kwargs)}
    if getattr(config, "sliding_window", None) is not None:  # every layer slides (Mistral's rule)
        return create_sliding_window_causal_mask(**kwargs)
    return create_causal_mask(**kwargs)


def final_hidden(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 document_ids: torch.Tensor | None = None, single_document: bool | None = None) -> torch.Tensor:
    """The decoder's final-normed hidden states [B, S, D] of packed rows (module docstring)."""
    decoder = model.get_decoder()
    mask = None
    if document_ids is not None and not single_document:
        mask = document_mask(model.config, input_ids, document_ids, decoder.embed_tokens.weight.dtype)
    out = decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def call_on(model: nn.Module, fn, mb: MicroBatch):
    """`fn(model, mb)`: the root's FSDP forward method (`FSDP_RUN`) once parallelize.py sets it."""
    return fn(model, mb)


def _run(model: nn.Module, fn, mb: MicroBatch):
    run = getattr(model, FSDP_RUN, None)
    return fn(model, mb) if run is None else run(fn, mb)


def loss_sum(model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 summed cross-entropy over the supervised targets, their count) of one packed micro-batch."""
    return _run(model, _loss_sum, mb)


def token_logps(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """fp32 [B, S] log-probability of each supervised target (0 elsewhere)."""
    return _run(model, _token_logps, mb)


def _loss_sum(model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    hidden_BSD = final_hidden(model, mb.input_ids, mb.position_ids, mb.document_ids, mb.single_document)
    return chunked_cross_entropy(hidden_BSD, model.get_output_embeddings().weight, mb.targets,
                                 LOSS_CHUNK_SIZE, num_supervised=mb.num_supervised, grad_scale=mb.loss_scale)


def _token_logps(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    hidden_BSD = final_hidden(model, mb.input_ids, mb.position_ids, mb.document_ids, mb.single_document)
    return chunked_token_logps(hidden_BSD, model.get_output_embeddings().weight, mb.targets,
                               LOSS_CHUNK_SIZE, num_supervised=mb.num_supervised)
