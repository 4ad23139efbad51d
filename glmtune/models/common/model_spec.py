"""`ModelSpec`: the front door of a model family, the one object the commands ask for a model.

A family (`glmtune/models/<family>/`) builds one in its `spec.py`, and
`glmtune/models/registry.py` lists the families. train/, plan/, preflight/, eval/, release/,
checkpoint/, peft/, generation/ and cli/ reach a family only through it (tests/test_layout.py
checks the imports), so a second family adds a folder and a spec, not edits across the tree.

A spec is a typed object of a few fields, each answering one kind of question, in the order a
run asks them:

  family         the torch-free answers (family.py `ModelFamily`: name, config.json's model_type,
                 presets, config.json read alone, `model.overrides`, the layout check's `dims`,
                 the pipeline split's `stage_costs`), which `config validate` and `--help` use
  hf_architecture  config.json `architectures[0]` (transformers' class name)
  architecture   `Architecture`: the family's args of an HF directory (its weights checked), of a
                 built model, and their numbers (vocabulary, layers, truncations, FLOPs per token,
                 parameter groups, the summary and parameter report `glmtune inspect` prints)
  weights        `Weights`: build (on meta or materialized), load whole or sharded, save, export a
                 training checkpoint, K-layer views, the FP8 base, the state-dict adapter (the only
                 place HF key names live)
  compute        `Compute`: what runs a built model: the training loss and log-probs of a
                 micro-batch (`microbatch.MicroBatch`), the serving metrics, the parallelization
                 plan (PP -> EP -> CP -> AC -> compile -> FSDP2) and the step runner it returns
                 (step_runner.py), through which everything runs the model
  hf_format      what checkpoint/'s HF readers, verifier and writers need (hf_format.py; None:
                 they refuse the family)
  decoding       the cached-decoding hooks `glmtune.generation` drives (decoding.py; None: none)
  lora           what `glmtune.peft` needs of the family's modules (lora_rules.py; None: peft/
                 refuses the family's models)
  memory         what `glmtune plan` needs to walk a step's memory (memory_model.py; None: plan
                 refuses the family)

Knows no family and imports only its neighbours in models/common/: the methods take and return
the family's own objects (`args` is the family's architecture type).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glmtune.models.common.decoding import CachedDecoding
from glmtune.models.common.family import ModelFamily
from glmtune.models.common.hf_format import HfFormat
from glmtune.models.common.lora_rules import LoraRules
from glmtune.models.common.memory_model import MemoryModel
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import PlainRunner, StepRunner


class Architecture(ABC):
    """A family's architecture (`args`): read from an HF directory or a built model, and its numbers."""

    param_groups: tuple[str, ...]  # the groups `param_group` answers, in report order

    @abstractmethod
    def args_from_hf(self, path: str | Path) -> Any:
        """The architecture of an HF directory (or its config.json), checked against the directory's
        weights when it holds them (`ModelFamily.read_args` reads config.json alone)."""

    @abstractmethod
    def args_of(self, model: Any) -> Any:
        """The architecture a built model was made from."""

    @abstractmethod
    def vocab_size(self, args: Any) -> int: ...

    @abstractmethod
    def num_layers(self, args: Any) -> int: ...

    @abstractmethod
    def truncated(self, args: Any, num_layers: int) -> Any:
        """`args` with its first `num_layers` decoder layers (preflight's small replicas)."""

    @abstractmethod
    def covering_layers(self, args: Any) -> int:
        """The fewest leading decoder layers that hold every kind of layer the model has."""

    @abstractmethod
    def truncated_overrides(self, args: Any, num_layers: int) -> dict[str, Any]:
        """The `model.overrides` (config.json keys) that cut preset `args` to its first `num_layers`
        decoder layers, as a recipe override gives them (preflight's scratch runs of a preset)."""

    @abstractmethod
    def flops_per_token(self, args: Any, doc_lengths: list[int]) -> float:
        """Model FLOPs (forward + backward) per token over documents of these lengths."""

    @abstractmethod
    def param_group(self, name: str) -> str:
        """The group (one of `param_groups`) a parameter name belongs to."""

    @abstractmethod
    def summary(self, args: Any) -> dict[str, Any]:
        """The architecture in a few numbers (`glmtune inspect`, preflight)."""

    @abstractmethod
    def architecture_rows(self, summary: dict[str, Any]) -> list[tuple[str, str]]:
        """The architecture table `glmtune inspect` prints: (label, text) rows of `summary`'s numbers."""

    @abstractmethod
    def parameter_report(self, args: Any) -> dict[str, Any]:
        """Parameters total and active per token, by layer (`glmtune inspect`)."""

    @abstractmethod
    def layer_runs(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Consecutive layers of one kind merged, from `parameter_report`'s per-layer rows."""


class Weights(ABC):
    """A family's models built, loaded and written (HF directories, training checkpoints, views)."""

    @abstractmethod
    def build(self, args: Any, dtype: Any, device: Any, model_cfg: Any = None, seed: int | None = None,
              init: bool = True) -> Any:
        """The model of `args` in `dtype` on `device` ("meta": no storage), with the backends and
        knobs of `model_cfg` (the recipe's `model` section; None: the defaults)."""

    @abstractmethod
    def build_from_config(self, model_cfg: Any, dtype: Any, device: Any, seed: int | None = None
                          ) -> tuple[Any, Path | None]:
        """The model the recipe's `model` section names and the HF directory it came from (None
        for a preset): a preset initialized from `seed`, an HF directory loaded whole, or on
        "meta" built empty (FP8 base converted) for `load_sharded` after `parallelize`."""

    @abstractmethod
    def load_pretrained(self, path: str | Path, dtype: Any, device: Any, model_cfg: Any = None) -> Any:
        """The HF directory `path` loaded whole on `device`, with the backends of `model_cfg` (the
        recipe's `model` section; None: the defaults)."""

    @abstractmethod
    def load_sharded(self, model: Any, hf_dir: str | Path, device: Any,
                     not_in_checkpoint: set[str] = frozenset()) -> Any:
        """Fill a meta-built, parallelized model from `hf_dir`, each rank reading its shards."""

    @abstractmethod
    def save_pretrained(self, model: Any, path: str | Path, **options: Any) -> Path:
        """Write the model as an HF directory (collective under FSDP2/EP/PP)."""

    @abstractmethod
    def export_checkpoint(self, model: Any, checkpoint_dir: str | Path, path: str | Path,
                          base_dir: str | Path | None = None, **options: Any) -> Path:
        """Write a full fine-tuning run's DCP checkpoint as the HF directory `save_pretrained`
        writes for `model` (built on meta) holding its weights, a bounded group of tensors at a time;
        `base_dir`: the HF directory the run started from (None: a preset), for what a family's
        export takes from it beside the weights (the hf family: its generation_config.json)."""

    # whether `truncated_view` writes K-layer views (False: it refuses; preflight's scratch runs train the
    # whole model where it is small enough)

    truncated_views: bool = True

    @abstractmethod
    def truncated_view(self, src: str | Path, dst: str | Path, num_layers: int) -> Path:
        """The first `num_layers` layers of checkpoint `src` as an HF directory that reads its files."""

    @abstractmethod
    def convert_to_fp8_base(self, model: Any, backend: str, errors: list | None = None) -> list[str]:
        """Freeze the base in FP8 with 128x128 block scales (names of converted modules); with
        `errors` (a list), each quantized weight appends its (squared error, squared norm) in fp64
        (`glmtune merge --fp8`'s report)."""

    @abstractmethod
    def reset_buffers(self, model: Any) -> None:
        """Set the non-persistent buffers of a model materialized by `to_empty` (no checkpoint holds
        them: rotary frequencies computed as at construction, counters zero)."""

    @abstractmethod
    def state_dict_adapter(self, args: Any) -> Any:
        """The family's HF key adapter for `args` (the only place HF key names live)."""


class Compute(ABC):
    """What runs a built model of the family: losses, log-probs, parallelization and its step runner."""

    @abstractmethod
    def loss(self, model: Any, mb: MicroBatch) -> tuple[Any, ...]:
        """(summed token loss, supervised tokens[, statistics]) of one packed micro-batch on the
        model's device. `mb.aux` (`aux_loss.AuxiliaryScales`) adds the family's auxiliary losses,
        differentiated with the main one; their (sum, count) pairs come back as statistics."""

    @abstractmethod
    def token_logps(self, model: Any, mb: MicroBatch) -> Any:
        """fp32 [B, S] log-probability of each supervised target of one packed micro-batch on the
        model's device (0 elsewhere)."""

    def last_token_logits(self, model: Any, input_ids_BS: Any) -> Any:
        """[B, V] logits of the token after each row of `input_ids_BS`, without a cache (the greedy
        before/after samples re-run the whole prefix). transformers' convention; a family whose
        forward differs overrides it."""
        return model(input_ids=input_ids_BS).logits[:, -1]

    def serving_metrics(self, model: Any, batch: dict[str, Any]) -> dict[str, Any]:
        """What a server of the model relies on beyond its answers, teacher-forced over one packed
        batch (no gradient): name -> (sum, count) fp32 [2], summed over batches and reported as
        sum / count. `mtp_acceptance`: the multi-token-prediction layer's drafts the model itself
        would emit; `indexer_recall`: the attention mass the sparse selection keeps. A family
        without those parts returns {} (the evaluation says "not available")."""
        return {}

    @abstractmethod
    def set_auxiliary_training(self, model: Any, mtp: bool, indexer: bool) -> None:
        """Make the multi-token-prediction layers / the sparse-attention indexers trainable (before
        sharding); a family without them refuses in one sentence."""

    @abstractmethod
    def parallelize(self, model: Any, mesh: Any, parallel_cfg: Any, pipeline: Any = None) -> StepRunner:
        """Apply the family's parallelization plan for the recipe's `parallel` section; the step
        runner of the result (`step_runner`)."""

    def step_runner(self, model: Any) -> StepRunner:
        """What runs micro-batches through `model` (step_runner.py): the runner `parallelize` built
        (a pipeline's), else the whole model, a model never parallelized included. A family with
        pipeline or context parallelism overrides it."""
        return PlainRunner(model, self.loss, self.token_logps, self.moe_layers(model))

    @abstractmethod
    def pipeline_options(self, **options: Any) -> Any:
        """The family plan's pipeline options (schedule, split, microbatches, shapes)."""

    @abstractmethod
    def moe_layers(self, model: Any) -> list[tuple[str, Any]]:
        """(name, layer) of the MoE layers the forward pass routes through (router statistics,
        bias updates); each has `tokens_per_expert` and `gate.e_score_correction_bias`."""

    @abstractmethod
    def layers_per_stage(self, model: Any) -> list[int]:
        """The pipeline split `parallelize` chose: decoder layers per stage."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family's answers (see the module docstring): one instance per family."""

    family: ModelFamily  # the torch-free answers
    hf_architecture: str  # config.json `architectures[0]` (transformers' class name)
    architecture: Architecture
    weights: Weights
    compute: Compute
    hf_format: HfFormat | None = None  # checkpoint/'s HF readers, verifier, writers (None: they refuse the family)
    decoding: CachedDecoding | None = None  # the cached-decoding hooks (None: the family has none)
    lora: LoraRules | None = None  # glmtune.peft's hooks (None: peft/ refuses the family's models)
    memory: MemoryModel | None = None  # glmtune plan's memory model (None: plan refuses the family)
