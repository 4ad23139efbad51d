"""`MemoryModel`: what `glmtune plan` asks a family's architecture to walk one training step's memory.

plan/ keeps the layout arithmetic and knows no family: which parameters a rank holds under
FSDP2/HSDP, expert and pipeline parallelism (from the model built on the meta device), the
micro-batches a pipeline keeps in flight, gradient accumulation, FSDP2's gathered units and
the phases of a step (plan/memory.py). What depends on the family's modules is answered here,
from its args (its own architecture type) and a `StepShape`:

  layer            one decoder layer's activations for a micro-batch: what autograd keeps from
                   its forward to its backward under the recipe's activation checkpointing, what
                   its backward recomputes, its backward's scratch, and what it holds for a
                   moment (an all-to-all buffer, a dequantized weight)
  step_terms       the rest of a rank's step: tensors held the whole step (the rotary tables) or by
                   each micro-batch in flight (attention masks), the last stage's loss rows, the
                   forward's largest scratch, the LM head's size (the fused loss computes its
                   gradient in forward), and the activations a pipeline stage sends on
  auxiliary        a family's extra training losses on the last stage (GLM-5's MTP layer)
  unit_of, routed_expert   how the family's parameter names map to the FSDP units its
                   parallelization wraps ("layer.{i}", "embed", "head", or a family's own, such as
                   GLM-5's "mtp.{j}") and which parameters are routed experts (split over `ep`)
  weight_std       the random weights' scale of a measured rank (`glmtune plan --measure`)
  check_layout     whether the layer the formulas assume is the built model's (its parameter count)

Bytes are the compute dtype's (`StepShape.compute_bytes`) unless a formula says otherwise.
A family's formulas say in their module which tensors they count and how they were checked.
torch-free (`glmtune --help` imports model_spec.py, which imports this).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepShape:
    """One rank's micro-batch and the recipe's settings that change what a layer keeps."""

    rows: int  # packed rows per micro-batch
    seq: int  # tokens per packed row
    cp: int = 1  # context-parallel degree (queries split, keys gathered)
    one_document: bool = True  # rows hold one document each (the plain-causal path applies)
    compute_bytes: int = 2  # the dtype layers compute in (2: bf16, 4: fp32)
    activation_checkpointing: str = "none"  # parallel.activation_checkpointing: none, full, selective
    lora_rank: int = 0  # adapters on the projections (0: none)
    ep: int = 1  # expert-parallel degree
    # settings only some families honour (the others refuse them at config time)
    ac_keep_matmul_min_k: int = 0  # selective checkpointing keeps matmul outputs reducing over >= this
    score_buffer_bytes: int = 0  # model.attention_score_buffer_mib, in bytes
    fp8_base: bool = False  # model.fp8_base: a frozen FP8 base, dequantized one projection at a time
    mtp: bool = False  # train.mtp_loss_weight > 0: the multi-token-prediction layer runs
    absorbed_attention: bool = False  # MLA's absorbed form over the selected keys (attention_backend absorbed*)
    fused_norms: bool = False  # model.norm_backend: triton (each norm keeps its input and 1/rms)
    kept_exchanges: int = 0  # parallel.ep_keep_exchanges: expert all-to-alls whose rows full AC keeps (0-2)
    fp8_in_gemm: bool = False  # model.fp8_base: triton: the GEMMs read the e4m3 weight (no dequantized copy)

    @property
    def queries(self) -> int:
        """Query tokens this rank computes per micro-batch."""
        return self.rows * self.seq // self.cp

    @property
    def keys(self) -> int:
        """Key tokens its attention reads (every token of the rows under context parallelism)."""
        return self.rows * self.seq


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer's bytes for one micro-batch (module docstring)."""

    kept: int  # saved from the layer's forward to its backward, as checkpointing keeps it
    recomputed: int  # what the layer's backward brings back by running its forward again
    backward_scratch: int  # allocated inside its backward beyond `kept + recomputed`
    transients: dict[str, int] = field(default_factory=dict)  # held for a moment during its backward
    # Kept from the previous layer of the same pipeline stage beyond the hidden states, per micro-batch
    # (GLM-5: the sparse-attention selection a full-indexer layer hands to a shared-indexer layer, which
    # keeps it as an input); nothing at a stage's first layer (a carried selection is a stage boundary's).
    input_kept: int = 0


@dataclass(frozen=True)
class StepTerms:
    """What a rank holds besides its layers' activations (module docstring)."""

    fixed: dict[str, int]  # alive the whole step (masks, rotary tables)
    loss: dict[str, int]  # the last stage's final norm and loss rows (empty elsewhere)
    forward_scratch: int  # the forward's largest transient (a logits slice of the loss, a score chunk)
    transients: dict[str, int]  # held for a moment in forward (and by each layer `LayerMemory` names them for)
    head_elements: int  # elements of the LM head's weight
    # Held by each micro-batch (each pipeline stage-chunk) from its forward to its backward beside the
    # layers' own activations, so once per micro-batch in flight (GLM-5: the attention mask a stage's
    # forward builds, which its checkpointed layers keep as an input).
    per_microbatch: dict[str, int] = field(default_factory=dict)
    # Bytes of each activation one micro-batch sends across a pipeline stage boundary that the plan
    # counts the buffers of (plan/memory.py: receive buffers, stage outputs; GLM-5: the next tokens'
    # embeddings of its MTP loss), and how much of them a stage's first layer already counts in its
    # `LayerMemory.kept` (a received tensor that is its input).
    boundary: tuple[int, ...] = ()
    received_kept: int = 0


class MemoryModel(ABC):
    """One family's memory model (module docstring). Stateless: one instance per family."""

    @abstractmethod
    def layer(self, args: Any, step: StepShape, index: int) -> LayerMemory:
        """Decoder layer `index`'s activations for one micro-batch of `step`."""

    @abstractmethod
    def step_terms(self, args: Any, step: StepShape, layers: list[int], last: bool) -> StepTerms:
        """The rest of a rank's step; `layers`: the decoder layers it runs, `last`: it runs the head."""

    def auxiliary(self, args: Any, step: StepShape, head_grad: int) -> tuple[dict[str, int], dict[str, int]]:
        """The last stage's auxiliary losses: (held at the forward's end, held during their backward,
        which runs first); `head_grad`: the bytes of the LM head's gradient one fused loss computes.
        None by default."""
        return {}, {}

    def auxiliary_held(self, args: Any, step: StepShape, head_grad: int) -> dict[str, int]:
        """What each auxiliary loss's forward keeps until its backward beside the main loss's head weight
        gradient (a pipeline's last-stage chunk in flight holds it through other stages' backwards).
        None by default."""
        return {}

    def auxiliary_units(self, step: StepShape) -> tuple[str, ...]:
        """FSDP units beyond the decoder layers and the root that the last stage runs (a pipeline
        keeps them gathered)."""
        return ()

    @abstractmethod
    def unit_of(self, name: str) -> str:
        """The FSDP unit parameter `name` belongs to: "layer.{i}", "embed" (the root's input end),
        "head" (final norm and LM head), or a family's own unit."""

    def check_layout(self, args: Any, parameters: int) -> str | None:
        """None when the layer layout the formulas assume accounts for the built model's `parameters`
        (its base parameters, adapters aside); else a sentence for the plan: its activations are then
        an estimate. Not checked by default."""
        return None

    @abstractmethod
    def weight_std(self, args: Any) -> float:
        """The standard deviation of the random weights `glmtune plan --measure` fills a rank with: the
        family's initializer range (what a router's scores, and so the experts' loads, start from)."""

    def routed_expert(self, name: str) -> bool:
        """Whether parameter `name` belongs to a routed-experts module (split on dim 0 over ep)."""
        return False
