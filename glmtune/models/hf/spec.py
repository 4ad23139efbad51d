"""The `hf` family's front door: `HF`, the `ModelSpec` of any causal LM transformers implements.

It wires the family's pieces into the spec's three parts, `HfArchitecture`, `HfWeights` and
`HfCompute` (models/common/model_spec.py), and its hooks. Where each answer lives:

  args, dims, stage costs    family.py (`HF_FAMILY`, torch-free: args.py's `HfArgs`, shapes.py);
                             an HF directory's args checked against its weights (weights.py)
  build                      model.py `build_model` (transformers' `AutoModelForCausalLM.from_config`)
  load whole, save           transformers' `from_pretrained` (safetensors only, local files, no remote
                             code) and `save_pretrained`, written atomically through glmtune/io/outputs.py;
                             an FSDP2 model's shards gathered to rank 0 first
  export of a checkpoint     checkpoint/export_stream.py (a DCP training checkpoint streamed into the
                             files `save_pretrained` writes; config.json and generation_config.json by
                             transformers' own writers, hf_files.py)
  sharded load               sharded_load.py (meta-built and parallelized, filled on every rank)
  state-dict adapter         state_dict_adapter.py (HF names; MoE experts split per expert as
                             transformers' conversion table stores them)
  loss, token log-probs      model.py: glmtune's chunked loss on the final hidden states, packed
                             documents kept apart by transformers' own mask builders
  flops                      shapes.py
  parallelize                parallelize.py (AC -> compile -> FSDP2; EP, PP, CP refused)
  memory model               memory_model.py (`glmtune plan`'s, from config.json's shapes; the
                             layer's layout and exact parameter count in memory_layout.py)
  cached decoding            decoding.py (transformers' own DynamicCache and decoder forward)
  summary, parameter report  summary.py (`glmtune inspect`: from config.json's shapes, memory_layout.py's
                             exact count; active per token: top-k of each MoE layer's experts)

Not done yet, each refused with a ValueError naming it (`_not_yet`): truncated views, an FP8 base,
the pipeline, presets' truncation overrides. `moe_layers` is empty: transformers' MoE layers keep
no per-expert token counts or correction biases for the trainer to read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from glmtune.checkpoint.export_stream import stream_export
from glmtune.config.schema import ModelConfig, ParallelConfig
from glmtune.io.outputs import output_dir
from glmtune.models.common.distill_loss import distilling, with_teacher_kl
from glmtune.models.common.loss import chunked_cross_entropy
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.model_spec import Architecture, Compute, ModelSpec, Weights
from glmtune.models.common.step_runner import StepRunner
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.decoding import HF_DECODING
from glmtune.models.hf.family import HF_FAMILY
from glmtune.models.hf.hf_files import settle_config, write_configs
from glmtune.models.hf.hf_format import HF_FORMAT
from glmtune.models.hf.lora_rules import HfLoraRules
from glmtune.models.hf.memory_model import HF_MEMORY
from glmtune.models.hf.model import (FSDP_RUN, LOSS_CHUNK_SIZE, build_model, check_model, final_hidden, loss_sum,
                                     token_logps)
from glmtune.models.hf.parallelize import parallelize_hf
from glmtune.models.hf.quiet import no_progress_bars
from glmtune.models.hf.shapes import flops_per_token
from glmtune.models.hf.sharded_load import load_sharded, reset_rotary_buffers
from glmtune.models.hf.state_dict_adapter import HfStateDictAdapter
from glmtune.models.hf.summary import GROUPS, architecture_rows, architecture_summary, layer_runs, parameter_report
from glmtune.models.hf.weights import check_weights, holds_weights

# Files a serving stack needs besides the weights; copied from the source directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def _distilled_loss(model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(cross-entropy sum + λ · KL sum, supervised tokens, {ce, kl}) of one packed micro-batch: the
    family's loss (model.py `_loss_sum`) and the KL on the same final hidden states and head."""
    hidden_BSD = final_hidden(model, mb.input_ids, mb.position_ids, mb.document_ids, mb.single_document)
    head_VD = model.get_output_embeddings().weight
    ce_sum, num_targets = chunked_cross_entropy(hidden_BSD, head_VD, mb.targets, LOSS_CHUNK_SIZE,
                                                num_supervised=mb.num_supervised, grad_scale=mb.loss_scale)
    total, stats = with_teacher_kl(ce_sum, hidden_BSD, head_VD, mb.teacher, num_targets)
    return total, num_targets, stats


def _not_yet(what: str) -> ValueError:
    return ValueError(f"the hf family does not do {what} yet")


def gathered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """An FSDP2 model's full state dict on rank 0's CPU (empty elsewhere); every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class HfArchitecture(Architecture):
    """A transformers causal LM's architecture (`HfArgs`, from config.json; its weights checked)."""

    param_groups = GROUPS

    def args_from_hf(self, path: str | Path) -> HfArgs:
        """config.json's architecture, refused (one sentence naming the file and the tensor) when the
        directory's safetensors headers are not that model's (weights.py)."""
        args = HF_FAMILY.read_args(path)
        if holds_weights(path):
            check_weights(path, build_model(args, device="meta"), args.num_hidden_layers, HfStateDictAdapter(args))
        return args

    def args_of(self, model: nn.Module) -> HfArgs:
        config = {**model.config.to_dict(), "architectures": [type(model).__name__]}
        return HfArgs.from_config_dict(config, type(model).__name__)

    def vocab_size(self, args: HfArgs) -> int:
        return args.vocab_size

    def num_layers(self, args: HfArgs) -> int:
        return args.num_hidden_layers

    def truncated(self, args: HfArgs, num_layers: int) -> HfArgs:
        return args.with_layers(num_layers)

    def covering_layers(self, args: HfArgs) -> int:
        """The fewest leading layers holding every kind (dense MLP, MoE) the model has."""
        kinds = [i in args.moe_layers for i in range(args.num_hidden_layers)]
        return max(kinds.index(kind) for kind in set(kinds)) + 1

    def truncated_overrides(self, args: HfArgs, num_layers: int) -> dict[str, Any]:
        raise ValueError("the hf family has no presets, so no preset overrides to truncate one")


    def flops_per_token(self, args: HfArgs, doc_lengths: list[int]) -> float:
        return flops_per_token(args, doc_lengths)

    def param_group(self, name: str) -> str:
        if "embed_tokens" in name:
            return "embeddings"
        if name.startswith("lm_head"):
            return "head"
        if ".experts." in name:
            return "experts"
        if ".mlp.gate." in name or ".router." in name:
            return "router"
        if "self_attn." in name and "norm" not in name:
            return "attention"
        if ".mlp." in name:
            return "mlp"
        return "norm"


    def summary(self, args: HfArgs) -> dict[str, Any]:
        return architecture_summary(args)

    def architecture_rows(self, summary: dict[str, Any]) -> list[tuple[str, str]]:
        return architecture_rows(summary)

    def parameter_report(self, args: HfArgs) -> dict[str, Any]:
        """Parameters total and active per token, by group and layer, from config.json's shapes (summary.py)."""
        return parameter_report(args)

    def layer_runs(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return layer_runs(rows)


HF_ARCHITECTURE = HfArchitecture()


class HfWeights(Weights):
    """transformers' models built on meta or loaded by `from_pretrained`, written by `save_pretrained`."""

    truncated_views = False  # preflight trains a small model whole, and says so for a large one

    def build(self, args: HfArgs, dtype: torch.dtype = torch.float32, device: Any = "cpu",
              model_cfg: ModelConfig | None = None, seed: int | None = None, init: bool = True) -> nn.Module:
        return build_model(args, dtype, device, seed=seed, init=init)

    def build_from_config(self, model_cfg: ModelConfig, dtype: torch.dtype, device: Any,
                          seed: int | None = None) -> tuple[nn.Module, Path | None]:
        if model_cfg.overrides:
            HF_FAMILY.with_overrides(None, model_cfg.overrides)  # refused: the family has no presets
        if model_cfg.fp8_base != "none":
            raise _not_yet(f"model.fp8_base: {model_cfg.fp8_base} (an FP8 base)")
        path = Path(model_cfg.name_or_path)
        if str(device) == "meta":
            return build_model(HF_ARCHITECTURE.args_from_hf(path), dtype, "meta"), path
        return self.load_pretrained(path, dtype, device), path

    def load_pretrained(self, path: str | Path, dtype: torch.dtype, device: Any,
                        model_cfg: ModelConfig | None = None) -> nn.Module:
        """The HF directory loaded whole by transformers (safetensors only, no remote code), after its
        weights are checked against its config.json (`model_cfg`: transformers' modules have no
        backends to choose)."""
        args = HF_ARCHITECTURE.args_from_hf(path)
        if not holds_weights(path):
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json to load")
        with no_progress_bars():  # glmtune reports the load itself (quiet.py)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                         use_safetensors=True, trust_remote_code=False)
        check_model(model, args)
        return model.to(device)

    def load_sharded(self, model: nn.Module, hf_dir: str | Path, device: Any,
                     not_in_checkpoint: set[str] = frozenset()) -> Any:
        return load_sharded(model, hf_dir, HF_ARCHITECTURE.args_from_hf(hf_dir), device, not_in_checkpoint)

    def save_pretrained(self, model: nn.Module, path: str | Path, max_shard_size: int | str = "5GB",
                        source_dir: str | Path | None = None, overwrite: bool = True,
                        sources: tuple[tuple[str, str | Path], ...] = (), dtype: torch.dtype | None = None,
                        pp_group: Any = None) -> Path:
        """Write `model` as an HF directory transformers loads back (its own `save_pretrained`, so MoE
        experts get their per-expert names), atomically; `source_dir`'s tokenizer files alongside;
        `dtype`: the tensors (and config.json's dtype) cast to it. An FSDP2-sharded model: every rank
        calls this (its shards are gathered to rank 0's CPU memory), rank 0 writes."""
        if pp_group is not None:
            raise _not_yet("saving a pipelined model")
        sharded = isinstance(model, FSDPModule)
        state = gathered_state(model) if sharded else None  # a collective: every rank of the mesh takes part
        if sharded and dist.get_rank() != 0:
            return Path(path)
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in (state or model.state_dict()).items()}
        if source_dir is not None:
            sources = (*sources, ("source_dir", source_dir))
        with output_dir(path, overwrite=overwrite, sources=sources, what="path", option="overwrite=True") as tmp:
            with no_progress_bars():  # glmtune reports the export itself (quiet.py)
                model.save_pretrained(tmp, max_shard_size=max_shard_size, state_dict=state)
            settle_config(tmp, model, dtype)  # not FSDP2's FSDP<class> subclass; the dtype written (hf_files.py)
            for name in TOKENIZER_FILES if source_dir is not None else ():
                if (Path(source_dir) / name).is_file():
                    shutil.copy2(Path(source_dir) / name, tmp / name)
        return Path(path)

    def export_checkpoint(self, model: nn.Module, checkpoint_dir: str | Path, path: str | Path,
                          base_dir: str | Path | None = None, **options: Any) -> Path:
        """The full fine-tuning run's DCP checkpoint as the directory `save_pretrained` writes for `model`
        (on meta) holding its weights, streamed (checkpoint/export_stream.py): the base's names, per-expert
        tensors, a tied head not stored; config.json and generation_config.json (the run's base
        `base_dir`'s, as `from_pretrained` keeps it) through transformers' own writers (hf_files.py)."""
        dtype = options.pop("dtype")
        return stream_export(model, checkpoint_dir, path, dtype, fmt=HF_FORMAT, args=HF_ARCHITECTURE.args_of(model),
                             write_config=lambda tmp: write_configs(tmp, model, dtype, base_dir), **options)

    def truncated_view(self, src: str | Path, dst: str | Path, num_layers: int) -> Path:
        raise _not_yet("truncated checkpoint views")

    def convert_to_fp8_base(self, model: nn.Module, backend: str, errors: list | None = None) -> list[str]:
        raise _not_yet("an FP8 base")

    def reset_buffers(self, model: nn.Module) -> None:
        reset_rotary_buffers(model)

    def state_dict_adapter(self, args: HfArgs) -> HfStateDictAdapter:
        return HfStateDictAdapter(args)



class HfCompute(Compute):
    """glmtune's chunked loss on transformers' final hidden states; AC, compile and FSDP2 per layer."""

    def loss(self, model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        if mb.aux is not None and (mb.aux.mtp or mb.aux.indexer):
            raise ValueError("train.mtp_loss_weight / train.indexer_loss_weight: the hf family has no "
                             "multi-token-prediction layer or indexer")
        if distilling(mb.teacher):  # distillation's KL term beside the cross-entropy (models/common/distill_loss.py)
            run = getattr(model, FSDP_RUN, None)  # under FSDP2: the root's forward method, its head gathered
            return _distilled_loss(model, mb) if run is None else run(_distilled_loss, mb)
        return loss_sum(model, mb)

    def token_logps(self, model: nn.Module, mb: MicroBatch) -> torch.Tensor:
        return token_logps(model, mb)

    def set_auxiliary_training(self, model: nn.Module, mtp: bool, indexer: bool) -> None:
        if mtp or indexer:
            raise ValueError("model family hf has no multi-token-prediction layer or indexer to train")

    def parallelize(self, model: nn.Module, mesh: Any, parallel_cfg: ParallelConfig, pipeline: Any = None
                    ) -> StepRunner:
        if pipeline is not None:
            raise _not_yet("pipeline parallelism")
        parallelize_hf(model, mesh=mesh, activation_checkpointing=parallel_cfg.activation_checkpointing,
                       compile=parallel_cfg.compile)
        return self.step_runner(model)  # the whole model: EP, PP and CP are refused

    def pipeline_options(self, **options: Any) -> Any:
        raise _not_yet("pipeline parallelism")

    def moe_layers(self, model: nn.Module) -> list[tuple[str, Any]]:
        return []  # module docstring: no router statistics or bias updates for transformers' MoE layers

    def layers_per_stage(self, model: nn.Module) -> list[int]:
        return [model.config.num_hidden_layers]  # one stage


HF = ModelSpec(family=HF_FAMILY, hf_architecture="*ForCausalLM",  # whatever config.json's `architectures[0]` names
               architecture=HF_ARCHITECTURE, weights=HfWeights(), compute=HfCompute(),
               hf_format=HF_FORMAT,  # checkpoint/'s HF verifier (`glmtune inspect --verify`); load and save: transformers'
               decoding=HF_DECODING, lora=HfLoraRules(), memory=HF_MEMORY)

