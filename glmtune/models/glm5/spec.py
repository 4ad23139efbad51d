"""GLM-5's front door: `GLM5`, the `ModelSpec` the commands ask for a GLM-5 family model.

It wires the family's pieces into the spec's three parts, `Glm5Architecture`, `Glm5Weights` and
`Glm5Compute` (models/common/model_spec.py), and its hooks; it holds no rule of its own. Where
each answer lives:

  presets, args, dims,       family.py (`GLM5_FAMILY`, torch-free: args.py's `PRESETS` and
  stage costs                `Glm5Args`, stage_costs.py); an HF directory's args checked against
                             its weights (checkpoint/hf_verify.py `check_loadable`), a lone
                             config.json's size bounded (size_bound.py, through the family)
  build                      model.py `build_model` (meta first; an FP8 base converted there)
  load whole / sharded, save checkpoint/hf_io.py, checkpoint/sharded_load.py,
                             checkpoint/export_stream.py (a DCP checkpoint to HF), handed
                             hf_format.py's `GLM5_HF_FORMAT` (config.json, HF names, model on meta)
  K-layer view               view_config.py (what it keeps), written by checkpoint/truncated_view.py
  state-dict adapter         state_dict_adapter.py
  loss, flops                model.py's fused loss; flops.py
  parallelize, step runner   parallelize.py (PP -> EP -> CP -> AC -> compile -> FSDP2; the pipeline's
                             runner under PP), else models/common/step_runner.py's `PlainRunner`
  param groups, describe     param_groups.py; summary.py, counts.py
  cached decoding            decode.py (`GLM5_DECODING`; the cache in kv_cache.py)
  LoRA hooks                 lora_rules.py (`GLM5_LORA`: glmtune.peft's)
  memory model               memory_model.py (`GLM5_MEMORY`: glmtune plan's; memory_activations.py)

Above the family's own code (it imports checkpoint/ and the parallelization plan): only this
module and the registry (`glmtune/models/registry.py`) sit on that floor.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from glmtune.checkpoint import hf_io
from glmtune.checkpoint.export_stream import stream_export
from glmtune.checkpoint.hf_verify import check_loadable, holds_weights
from glmtune.checkpoint.sharded_load import LoadStats, load_sharded, reset_non_persistent_buffers
from glmtune.checkpoint.truncated_view import truncated_view
from glmtune.config.schema import ModelConfig, ParallelConfig
from glmtune.models.common.distill_loss import distilling, with_teacher_kl
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.model_spec import Architecture, Compute, ModelSpec, Weights
from glmtune.models.common.rmsnorm import set_norm_backend
from glmtune.models.common.step_runner import PlainRunner, StepRunner
from glmtune.models.glm5.args import Glm5Args, covering_layers, truncated_args
from glmtune.models.glm5.attention import set_attention_score_buffer
from glmtune.models.glm5.counts import layer_runs, parameter_report
from glmtune.models.glm5.decode import GLM5_DECODING
from glmtune.models.glm5.family import GLM5_FAMILY
from glmtune.models.glm5.flops import flops_per_token
from glmtune.models.glm5.fp8_base import convert_to_fp8_base
from glmtune.models.glm5.hf_format import GLM5_HF_FORMAT
from glmtune.models.glm5.indexer_recall import RecallProbe
from glmtune.models.glm5.lora_rules import GLM5_LORA
from glmtune.models.glm5.memory_model import GLM5_MEMORY
from glmtune.models.glm5.model import Glm5ForCausalLM, build_model
from glmtune.models.glm5.moe import MoE, set_moe_dispatch_backend
from glmtune.models.glm5.parallelize import PipelineOptions, parallelize_glm5
from glmtune.models.glm5.param_groups import GROUPS, param_group
from glmtune.models.glm5.stages import decoder_layers
from glmtune.models.glm5.state_dict_adapter import Glm5StateDictAdapter
from glmtune.models.glm5.summary import architecture_rows, architecture_summary
from glmtune.models.glm5.view_config import view_args


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu",
                    attention_backend: str = "auto", moe_backend: str = "grouped_mm", indexer_backend: str = "auto",
                    fp8_base: str | None = None) -> Glm5ForCausalLM:
    """A local HF GLM-5 directory (config.json + safetensors) loaded whole into a glmtune model (the
    Python API's `glmtune.load_pretrained`).

    `fp8_base` (an FP8 matmul backend, `glmtune/kernels/fp8_matmul.py`) keeps the base frozen
    in FP8 (`glmtune/models/glm5/fp8_base.py`): FP8 tensors of the checkpoint are copied with
    their block scales as they are, bf16 ones are quantized; None dequantizes FP8 tensors."""
    return hf_io.load_pretrained(path, GLM5_HF_FORMAT, lambda args: build_model(
        args, dtype, device, attention_backend, moe_backend, init=False, indexer_backend=indexer_backend,
        fp8_base=fp8_base))


def save_pretrained(model: nn.Module, path: str | Path, **options: Any) -> Path:
    """A GLM-5 model written as an HF directory (`hf_io.save_pretrained`'s options; the Python API's
    `glmtune.save_pretrained`)."""
    return hf_io.save_pretrained(model, path, GLM5_HF_FORMAT, model.args, **options)


class Glm5Architecture(Architecture):
    """GLM-5's architecture (`Glm5Args`): from an HF directory (its weights checked) or a built model."""

    param_groups = GROUPS

    def args_from_hf(self, path: str | Path) -> Glm5Args:
        """config.json's architecture, refused (one sentence naming the file and the tensor) when
        the directory's weights are not that model's, or, with no weights beside it, when it
        describes more parameters than any machine glmtune plans for: every command reads an HF
        directory's architecture here before it builds anything at that size."""
        if not holds_weights(path):  # config.json alone: its size bounded (GLM5_FAMILY.read_args)
            return GLM5_FAMILY.read_args(path)
        args = Glm5Args.from_hf_config(path)
        # a missing or damaged file is the load's to name (and preflight's check 2)
        check_loadable(path, GLM5_HF_FORMAT, args, against_config_only=True)
        return args

    def args_of(self, model: nn.Module) -> Glm5Args:
        return model.args

    def vocab_size(self, args: Glm5Args) -> int:
        return args.vocab_size

    def num_layers(self, args: Glm5Args) -> int:
        return args.num_hidden_layers

    def truncated(self, args: Glm5Args, num_layers: int) -> Glm5Args:
        return truncated_args(args, num_layers)

    def covering_layers(self, args: Glm5Args) -> int:
        """The fewest leading layers holding every kind of layer (preflight's real-weights replica)."""
        return covering_layers(args)

    def truncated_overrides(self, args: Glm5Args, num_layers: int) -> dict[str, Any]:
        """The `model.overrides` (config.json keys) that cut preset `args` to its first `num_layers`
        decoder layers (its MTP layers kept: a preset builds them from the seed)."""
        cut = truncated_args(args, num_layers)
        return {key: getattr(cut, key) for key in ("num_hidden_layers", "mlp_layer_types", "indexer_types")}


    def flops_per_token(self, args: Glm5Args, doc_lengths: list[int]) -> float:
        return flops_per_token(args, args.num_hidden_layers, args.mlp_layer_types.count("dense"), doc_lengths)

    def param_group(self, name: str) -> str:
        return param_group(name)


    def summary(self, args: Glm5Args) -> dict[str, Any]:
        return architecture_summary(args)

    def architecture_rows(self, summary: dict[str, Any]) -> list[tuple[str, str]]:
        return architecture_rows(summary)

    def parameter_report(self, args: Glm5Args) -> dict[str, Any]:
        return parameter_report(args)

    def layer_runs(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Consecutive layers of one kind, merged (the report's per-layer rows)."""
        return layer_runs(rows)


GLM5_ARCHITECTURE = Glm5Architecture()


class Glm5Weights(Weights):
    """GLM-5 models built (model.py), loaded and written through checkpoint/ with `GLM5_HF_FORMAT`."""

    def build(self, args: Glm5Args, dtype: torch.dtype = torch.float32, device: Any = "cpu",
              model_cfg: ModelConfig | None = None, seed: int | None = None, init: bool = True) -> Glm5ForCausalLM:
        m = model_cfg or ModelConfig()
        model = build_model(args, dtype, device, m.attention_backend, m.moe_backend, init=init, seed=seed,
                            indexer_backend=m.indexer_backend)
        return self._configured(model, model_cfg)

    def build_from_config(self, model_cfg: ModelConfig, dtype: torch.dtype, device: Any,
                          seed: int | None = None) -> tuple[Glm5ForCausalLM, Path | None]:
        m = model_cfg
        if m.name_or_path in GLM5_FAMILY.presets:
            args = GLM5_FAMILY.with_overrides(GLM5_FAMILY.preset_args(m.name_or_path), m.overrides)
            model = build_model(args, dtype, device, m.attention_backend, m.moe_backend, seed=seed,
                                indexer_backend=m.indexer_backend)
            return self._configured(model, m), None
        if m.overrides:
            raise ValueError("model.overrides apply to presets only; edit the checkpoint's config.json instead")
        path, fp8 = Path(m.name_or_path), None if m.fp8_base == "none" else m.fp8_base
        if str(device) == "meta":  # load_sharded fills the weights (FP8: e4m3 and scales as stored)
            model = build_model(GLM5_ARCHITECTURE.args_from_hf(path), dtype, "meta", m.attention_backend, m.moe_backend,
                                indexer_backend=m.indexer_backend, fp8_base=fp8)
        else:
            model = load_pretrained(path, dtype, device, m.attention_backend, m.moe_backend,
                                    indexer_backend=m.indexer_backend, fp8_base=fp8)
        return self._configured(model, m), path

    @staticmethod
    def _configured(model: Glm5ForCausalLM, model_cfg: ModelConfig | None) -> Glm5ForCausalLM:
        """The recipe's knobs that are not construction arguments (dispatch and norm backends, score buffer)."""
        if model_cfg is not None:
            set_moe_dispatch_backend(model, model_cfg.moe_dispatch_backend)
            set_attention_score_buffer(model, model_cfg.attention_score_buffer_mib)
            set_norm_backend(model, model_cfg.norm_backend)
        return model

    def load_pretrained(self, path: str | Path, dtype: torch.dtype, device: Any,
                        model_cfg: ModelConfig | None = None) -> Glm5ForCausalLM:
        """The HF directory `path` loaded whole, with `model_cfg`'s backends (None: the defaults)."""
        if model_cfg is None:
            return load_pretrained(path, dtype, device)
        m = model_cfg
        return load_pretrained(path, dtype, device, m.attention_backend, m.moe_backend, indexer_backend=m.indexer_backend)

    def load_sharded(self, model: nn.Module, hf_dir: str | Path, device: Any,
                     not_in_checkpoint: set[str] = frozenset()) -> LoadStats:
        return load_sharded(model, hf_dir, GLM5_HF_FORMAT, model.args, device, not_in_checkpoint=not_in_checkpoint)

    def save_pretrained(self, model: nn.Module, path: str | Path, **options: Any) -> Path:
        return save_pretrained(model, path, **options)

    def export_checkpoint(self, model: nn.Module, checkpoint_dir: str | Path, path: str | Path,
                          base_dir: str | Path | None = None, **options: Any) -> Path:
        # `base_dir` unused: GLM-5's export writes no generation config (as its save_pretrained)
        return stream_export(model, checkpoint_dir, path, fmt=GLM5_HF_FORMAT, args=model.args, **options)

    def truncated_view(self, src: str | Path, dst: str | Path, num_layers: int) -> Path:
        """The first `num_layers` layers of checkpoint `src` as an HF directory reading its files."""
        small, config_updates = view_args(src, num_layers)
        return truncated_view(src, dst, num_layers, Glm5StateDictAdapter(small), config_updates)

    def convert_to_fp8_base(self, model: nn.Module, backend: str, errors: list | None = None) -> list[str]:
        return convert_to_fp8_base(model, backend, errors)

    def reset_buffers(self, model: nn.Module) -> None:
        reset_non_persistent_buffers(model)

    def state_dict_adapter(self, args: Glm5Args) -> Glm5StateDictAdapter:
        return Glm5StateDictAdapter(args)



class Glm5Compute(Compute):
    """GLM-5's fused loss, serving metrics and parallelization plan (parallelize.py)."""

    def loss(self, model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        # The auxiliary losses run as `mb.aux` sizes them (MTP: averaged over the step's own supervised
        # MTP tokens; the indexer KL: over the step's queries and the KL layers).
        out = model(mb.input_ids, mb, compute_logits=False)
        mtp, indexer = mb.aux is not None and mb.aux.mtp, mb.aux is not None and mb.aux.indexer
        if distilling(mb.teacher):  # distillation's KL term (models/common/distill_loss.py); no auxiliary loss
            # FSDP2's root keeps its weights gathered from forward to backward (parallelize.py): the head is whole.
            # Under context parallelism the hidden states are this rank's queries: the teacher's, too.
            teacher = mb.teacher.local(model.model.local_tokens)
            loss_sum, stats = with_teacher_kl(out.loss_sum, out.hidden_states, model.lm_head.weight, teacher,
                                              out.num_targets)
            return loss_sum, out.num_targets, stats
        if not mtp and not indexer:
            return out.loss_sum, out.num_targets
        stats = {"indexer_kl": out.indexer_kl} if indexer else {}
        if mtp:
            stats["mtp_loss"] = torch.stack([out.mtp_loss_sum.detach().float(), out.mtp_num_targets.float()])
            stats["mtp_acceptance"] = out.mtp_accepted
        return out.loss_sum, out.num_targets, stats

    @torch.no_grad()
    def serving_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """MTP acceptance (`Glm5Output.mtp_accepted`; a checkpoint without an MTP layer has none) and
        the main layers' indexer recall on sampled queries (`indexer_recall.py`), from one forward."""
        mtp = bool(model.mtp)
        mb = MicroBatch(batch["input_ids"], batch["position_ids"], batch["document_ids"],
                        mtp_targets=batch["mtp_targets"] if mtp else None,
                        longest_document=batch.get("longest_document"), single_document=batch.get("single_document"),
                        num_mtp_supervised=batch.get("num_mtp_supervised") if mtp else None)
        probe = RecallProbe(decoder_layers(model), model.args.index_topk)
        try:
            out = model(mb.input_ids, mb, compute_logits=False)
        finally:
            recall = probe.close()
        device = out.hidden_states.device
        metrics = {"indexer_recall": recall if recall is not None else torch.zeros(2, device=device)}
        if mtp:
            metrics["mtp_acceptance"] = out.mtp_accepted
        return metrics

    def set_auxiliary_training(self, model: nn.Module, mtp: bool, indexer: bool) -> None:
        if mtp and not model.mtp:
            raise ValueError("train.mtp_loss_weight > 0, but this checkpoint has no MTP layer "
                             "(config.json num_nextn_predict_layers: 0)")
        model.set_trainable_extras(mtp=mtp, indexer=indexer)

    def token_logps(self, model: nn.Module, mb: MicroBatch) -> torch.Tensor:
        targets_only = dataclasses.replace(mb, mtp_targets=None, aux=None)  # no auxiliary loss runs
        return model(mb.input_ids, targets_only, compute_logits=False, token_logps=True).token_logps

    def last_token_logits(self, model: nn.Module, input_ids_BS: torch.Tensor) -> torch.Tensor:
        hidden = model(input_ids_BS, compute_logits=False).hidden_states[:, -1:]  # the head on one position only
        return model.lm_head(hidden)[:, -1]

    def parallelize(self, model: nn.Module, mesh: Any, parallel_cfg: ParallelConfig,
                    pipeline: PipelineOptions | None = None) -> StepRunner:
        p = parallel_cfg
        parallelize_glm5(model, mesh=mesh, activation_checkpointing=p.activation_checkpointing,
                         ac_keep_matmul_min_k=p.ac_keep_matmul_min_k, compile=p.compile, ep_dispatcher=p.ep_dispatcher,
                         ep_overlap_chunks=p.ep_overlap_chunks, ep_keep_exchanges=p.ep_keep_exchanges,
                         cp_balance=p.cp_balance, pipeline=pipeline)
        return self.step_runner(model)

    def step_runner(self, model: nn.Module) -> StepRunner:
        """The pipeline's runner `parallelize_glm5` built under pipeline parallelism, else the whole
        model's (its context-parallel shard, if any, gathers whole rows)."""
        built = getattr(model, "step_runner", None)
        return built or PlainRunner(model, self.loss, self.token_logps, self.moe_layers(model),
                                    model.model.sequence_shard)

    def pipeline_options(self, **options: Any) -> PipelineOptions:
        return PipelineOptions(**options)

    def moe_layers(self, model: nn.Module) -> list[tuple[str, MoE]]:
        # MTP layers hold weights only: they take no part in the forward pass.
        return [(name, module) for name, module in model.named_modules()
                if isinstance(module, MoE) and not name.startswith("mtp.")]

    def layers_per_stage(self, model: nn.Module) -> list[int]:
        """The pipeline split `parallelize` chose (layers per stage), for the run's description."""
        return model.layers_per_stage


GLM5 = ModelSpec(family=GLM5_FAMILY, hf_architecture="GlmMoeDsaForCausalLM", architecture=GLM5_ARCHITECTURE,
                 weights=Glm5Weights(), compute=Glm5Compute(), hf_format=GLM5_HF_FORMAT, decoding=GLM5_DECODING,
                 lora=GLM5_LORA, memory=GLM5_MEMORY)

