"""What serving engines do with a glmtune LoRA adapter: the facts, the serve command, the refusals.

A trained adapter is worth shipping only if the engine applies it as training did. The table
`ENGINES` holds, per engine, what was checked against that engine's own loader code (the
version is in `checked`; docs/lora.md, "Serving with vLLM and SGLang"): the adapter layout it
loads exactly, the flags an adapter needs, and what it applies differently. `glmtune export
--engine` and `glmtune release --engine` read it:

  * `serve_command` is the exact command line that serves the base with the adapter;
  * `refusals` are one line each, with the fix, for an adapter the engine would apply
    differently from training (and would not say so): rsLoRA scaling where the engine always
    scales alpha/r, a routed-expert adapter on one of the two expert projections only, a rank
    above the engine's limit, a layout the engine does not load;
  * `caveats` are what the engine applies differently but knowingly, which a release records.

`AdapterTraits` describes an adapter by what the LoRA modules of the model adapt (no key names:
the modules themselves are inspected), so a run's config is enough to know before anything is
written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.param_groups import param_group
from glmtune.peft.lora import EXPERT_PARAMS, LoRAGroupedExperts, LoRALinear, lora_modules

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


@dataclass(frozen=True)
class EngineFacts:
    name: str
    checked: str  # the engine version the facts were read from
    layout: str  # the adapter layout it loads exactly (glmtune.peft.adapter_export.LAYOUTS)
    scales_rslora: bool  # applies alpha/sqrt(r) when the adapter says use_rslora
    applies_kv_b_in_decode: bool  # a kv_b_proj delta reaches attention (vLLM's absorbed MLA: never for GLM-5)
    max_rank: int | None  # the largest --max-lora-rank it accepts (None: no limit)
    max_lora_rank_default: int | None  # what --max-lora-rank is when not given (None: from the adapters)
    one_expert_projection: bool  # applies a routed-expert adapter on one of the two projections (with its command)
    notes: tuple[str, ...] = ()


ENGINES: dict[str, EngineFacts] = {
    "vllm": EngineFacts(
        "vllm", "0.34.0", "per_expert", scales_rslora=True, applies_kv_b_in_decode=False, max_rank=512,
        max_lora_rank_default=16, one_expert_projection=False,  # PackedLoRALayerWeights.pack_moe asserts
        notes=("the PEFT layout loads only with --enable-mixed-moe-lora-format and a LoRA request declaring "
               "is_3d_lora_weight: true",
               "--max-lora-rank defaults to 16",
               "--lora-target-modules copied from peft.target_modules leaves the routed experts unwrapped: "
               "not passed")),
    "sglang": EngineFacts(
        "sglang", "0.5.23", "per_expert", scales_rslora=False, applies_kv_b_in_decode=True, max_rank=None,
        max_lora_rank_default=None, one_expert_projection=True,  # with --lora-target-modules all (the command's)
        notes=("the PEFT layout is not served: target_parameters are ignored and the first request fails",
               "shared experts are fused into the routed layer (256 routed + 1 shared, sm80+, EP 1) unless "
               "--disable-shared-experts-fusion: their deltas would be zero",
               "an expert adapter on one projection is dropped silently when the adapter's target_modules lack the "
               "other projection's names, unless --lora-target-modules all (the command passes it)")),
}


@dataclass(frozen=True)
class AdapterTraits:
    rank: int
    alpha: float
    rslora: bool
    kv_b: bool  # an attention kv_b_proj is adapted
    shared_experts: bool  # a shared expert's projection is adapted
    expert_projections: frozenset[str] = field(default_factory=frozenset)  # routed: "gate_up_proj", "down_proj"


def adapter_traits(model: nn.Module, rank: int, alpha: float, rslora: bool) -> AdapterTraits:
    """What the LoRA modules of `model` (after `apply_lora`) adapt."""
    adapted = {id(module) for _, module in lora_modules(model)}
    kv_b = any(isinstance(m, MLAttention) and id(m.kv_b_proj) in adapted for m in model.modules())
    shared, projections = False, set()
    for name, module in lora_modules(model):
        if isinstance(module, LoRAGroupedExperts):
            projections |= {proj for proj in EXPERT_PARAMS if module.adapter(proj) is not None}
        elif isinstance(module, LoRALinear) and param_group(name) == "shared_experts":
            shared = True
    return AdapterTraits(rank, alpha, rslora, kv_b, shared, frozenset(projections))


def engine_facts(name: str) -> EngineFacts:
    if name not in ENGINES:
        raise ValueError(f"--engine {name}: no deployment facts for this engine; choose from {sorted(ENGINES)}")
    return ENGINES[name]


def refusals(engine: EngineFacts, traits: AdapterTraits, layout: str) -> list[str]:
    """One line per way `engine` would apply the adapter differently from training, each with its fix."""
    out = []
    if layout != engine.layout:
        out.append(f"{engine.name} loads the {engine.layout} layout exactly, not {layout}: export with "
                   f"--layout {engine.layout} (RUN_DIR/adapter_per_expert is that layout)")
    if traits.rslora and not engine.scales_rslora:
        out.append(f"{engine.name} {engine.checked} scales every adapter by alpha/r: this rsLoRA adapter "
                   f"(alpha/sqrt(r)) would be applied at {(traits.rank ** 0.5) / traits.rank:.3g}x its trained "
                   "update; train with peft.rslora false, or serve it with vllm")
    if len(traits.expert_projections) == 1 and not engine.one_expert_projection:
        [only] = traits.expert_projections
        out.append(f"the routed-expert adapter covers {only} only: {engine.name} {engine.checked} rejects an expert "
                   "adapter on one projection; target both expert projections (gate_up and down) or none, or "
                   "serve it with sglang")
    if engine.max_rank is not None and traits.rank > engine.max_rank:
        out.append(f"rank {traits.rank} is above {engine.name}'s largest --max-lora-rank {engine.max_rank}; "
                   f"train at rank <= {engine.max_rank}")
    return out


def caveats(engine: EngineFacts, traits: AdapterTraits) -> list[str]:
    """What the engine applies differently, knowingly (a release records it)."""
    if traits.kv_b and not engine.applies_kv_b_in_decode:
        return [f"{engine.name}'s MLA attention uses W_UK / W_UV precomputed from the base kv_b_proj (absorbed "
                "decode; under GLM-5's sparse MLA every token, prefill included): this adapter's kv_b_proj delta is "
                "not applied (docs/lora.md; leave kv_b_proj out of peft.target_modules, the default, for this "
                "engine)"]
    return []


def serve_command(engine: EngineFacts, base: str, adapter: str | None, traits: AdapterTraits | None,
                  name: str = "adapter") -> list[str]:
    """The command line that serves `base` (with `adapter` as the LoRA named `name`) on `engine`."""
    if engine.name == "vllm":
        command = ["vllm", "serve", base]
        if adapter is not None:
            rank = next(r for r in VLLM_RANKS if r >= traits.rank)
            command += ["--enable-lora", "--lora-modules", f"{name}={adapter}", "--max-lora-rank", str(rank),
                        "--max-loras", "1"]
        return command
    command = ["python", "-m", "sglang.launch_server", "--model-path", base]
    if adapter is not None:
        command += ["--enable-lora", "--lora-paths", f"{name}={adapter}", "--max-lora-rank", str(traits.rank),
                    "--lora-target-modules", "all"]
        if traits.shared_experts:
            command.append("--disable-shared-experts-fusion")
    return command
