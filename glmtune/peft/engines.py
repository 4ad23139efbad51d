"""What serving engines do with a glmtune LoRA adapter: the facts, the serve command, the refusals.

A trained adapter is worth shipping only if the engine applies it as training did. The table
`ENGINES` holds, per engine, what was checked against that engine's own loader code (the
version is in `checked`; docs/lora.md, "Serving with vLLM and SGLang"): the adapter layout it
loads exactly, the flags an adapter needs, and what it applies differently. `glmtune export
--engine` and `glmtune release --engine` read it:

  * `serve_command` is the exact command line that serves the base with the adapter (for SGLang
    the adapter's own module names, `sglang_target_modules`: `all` would take in the DSA indexer's
    `wq_b`, which SGLang refuses at start-up on GLM-5 on NVIDIA GPUs, where it fuses the indexer's
    projections; and shared-expert fusion off whenever the MoE layers take LoRA); the adapter's
    `--lora-modules` / `--lora-paths` item is NAME=PATH, or the engine's JSON form when the path or
    name would not survive the engine's split (`lora_item`);
  * `refusals` are one line each, with the fix, for an adapter the engine would apply
    differently from training (and would not say so) or would not load: rsLoRA scaling where the
    engine always scales alpha/r, a routed-expert adapter on one of the two expert projections
    only, a rank above the engine's limit, a layout the engine does not load, MTP-layer adapters
    (a run with `train.mtp_loss_weight > 0`) where the engine refuses them (SGLang: any; vLLM: an
    adapted `eh_proj`);
  * `caveats` are what the engine applies differently but knowingly, which a release records and
    `glmtune export --engine` prints as a warning: a kv_b_proj delta vLLM's MLA never applies,
    MTP-layer adapters vLLM loads and never applies (its draft model runs the base MTP layer).

Neither engine applies an adapter to its MTP draft model (docs/lora.md, "The MTP layer under
LoRA"): the trained drafter is served by merging (`glmtune merge`), which every refusal and
caveat about the MTP layer says.

`AdapterTraits` describes an adapter by what the LoRA modules of the model adapt (no key names:
the modules themselves are inspected; an MTP layer is named as on disk by the state-dict
adapter, for the messages), so a run's config is enough to know before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from torch import nn

from glmtune.peft.family import hf_prefix, spec_of
from glmtune.peft.lora import EXPERT_PARAMS, LoRAGroupedExperts, LoRALinear, lora_modules

VLLM_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts
# The names SGLang 0.5.23's --lora-target-modules accepts besides `all` (its argparse choices,
# srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES; `make test-engines` compares the installed list).
SGLANG_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                         "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                         "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")
# The leaf names a routed-expert projection is written under in the per-expert layout (adapter_export.py).
EXPERT_LEAVES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class EngineFacts:
    name: str
    checked: str  # the engine version the facts were read from
    layout: str  # the adapter layout it loads exactly (glmtune.peft.adapter_export.LAYOUTS)
    scales_rslora: bool  # applies alpha/sqrt(r) when the adapter says use_rslora
    applies_kv_b: bool  # a kv_b_proj delta reaches attention (vLLM: neither absorbed decode nor prefill)
    max_rank: int | None  # the largest --max-lora-rank it accepts (None: no limit)
    max_lora_rank_default: int | None  # what --max-lora-rank is when not given (None: from the adapters)
    one_expert_projection: bool  # applies a routed-expert adapter on one of the two projections (with its command)
    # An adapter holding an MTP layer's tensors (`model.layers.{L + j}.*`, a run with the MTP loss):
    loads_mtp_layer: bool  # loads it (SGLang: its LoRAAdapter holds num_hidden_layers layers, IndexError)
    loads_mtp_eh_proj: bool  # loads it when the MTP layer's eh_proj is adapted (no module of the target model)
    applies_mtp_layer: bool  # its MTP draft model (speculative decoding) applies those tensors
    notes: tuple[str, ...] = ()


ENGINES: dict[str, EngineFacts] = {
    "vllm": EngineFacts(
        "vllm", "0.34.0", "per_expert", scales_rslora=True, applies_kv_b=False, max_rank=512,
        max_lora_rank_default=16, one_expert_projection=False,  # PackedLoRALayerWeights.pack_moe asserts
        # LoRAModel.from_local_checkpoint: MTP tensors pass by leaf name (unused), eh_proj is an unexpected module;
        # the draft model (DeepseekV32MTP) is not SupportsLoRA
        loads_mtp_layer=True, loads_mtp_eh_proj=False, applies_mtp_layer=False,
        notes=("the PEFT layout loads only with --enable-mixed-moe-lora-format and a LoRA request declaring "
               "is_3d_lora_weight: true",
               "--max-lora-rank defaults to 16",
               "--lora-target-modules copied from peft.target_modules leaves the routed experts unwrapped: "
               "not passed")),
    "sglang": EngineFacts(
        "sglang", "0.5.23", "per_expert", scales_rslora=False, applies_kv_b=True, max_rank=None,
        max_lora_rank_default=None, one_expert_projection=True,  # the command names both projections
        # LoRAAdapter._process_weight: IndexError on model.layers.{L}; no LoRA manager on the draft worker
        loads_mtp_layer=False, loads_mtp_eh_proj=False, applies_mtp_layer=False,
        notes=("the PEFT layout is not served: target_parameters are ignored and the first request fails",
               "--lora-target-modules all takes in the DSA indexer's wq_b: on NVIDIA GPUs (indexer_rope_interleave, "
               "GLM-5's) the indexer is fused and the server refuses to start; the command names the adapter's "
               "modules",
               "shared experts are fused into the routed layer (256 routed + 1 shared, sm80+, EP 1) unless "
               "--disable-shared-experts-fusion: a shared expert's delta would be zero, and an MoE layer taking "
               "LoRA has 257 expert slots against 256-expert LoRA buffers (the MoE LoRA runners refuse it)",
               "an expert adapter on one projection is dropped silently unless --lora-target-modules names the "
               "other projection too (the MoE layer is wrapped only with both; the command names both)")),
}


@dataclass(frozen=True)
class AdapterTraits:
    rank: int
    alpha: float
    rslora: bool
    kv_b: bool  # an attention kv_b_proj is adapted
    shared_experts: bool  # a shared expert's projection is adapted
    expert_projections: frozenset[str] = field(default_factory=frozenset)  # routed: "gate_up_proj", "down_proj"
    mtp_layers: tuple[str, ...] = ()  # the MTP layers holding adapters, by their on-disk names (model.layers.{L + j})
    mtp_eh_proj: tuple[str, ...] = ()  # the adapted eh_proj of MTP layers, on disk (peft.target_modules "*.eh_proj")
    modules: frozenset[str] = frozenset()  # the per-expert adapter_config's target_modules: adapted leaf names


def adapter_traits(model: nn.Module, rank: int, alpha: float, rslora: bool) -> AdapterTraits:
    """What the LoRA modules of `model` (after `apply_lora`; with the MTP loss, after
    `set_auxiliary_training(mtp=True)`, as training did) adapt."""
    adapted = {id(module) for _, module in lora_modules(model)}
    spec = spec_of(model)
    assert spec.lora is not None
    kv_b = any(id(m) in adapted for m in spec.lora.absorbed_projections(model))
    shared, projections, leaves = False, set(), set()
    for name, module in lora_modules(model):
        if isinstance(module, LoRAGroupedExperts):
            adapted_projections = {proj for proj in EXPERT_PARAMS if module.adapter(proj) is not None}
            projections |= adapted_projections
            leaves.update(leaf for proj in adapted_projections for leaf in EXPERT_LEAVES[proj])
        else:
            leaves.add(name.rpartition(".")[2])
            shared |= isinstance(module, LoRALinear) and spec.architecture.param_group(name) == "shared_experts"
    mtp = [(name, eh_proj) for name, layer, eh_proj in spec.lora.mtp_layers(model)
           if any(id(m) in adapted for m in layer.modules())]
    # the on-disk name of the layer (`mtp.{j}` -> `model.layers.{L + j}`) is the state-dict adapter's
    on_disk = hf_prefix(model)
    mtp_layers = tuple(on_disk(f"{name}.eh_proj").removesuffix(".eh_proj") for name, _ in mtp)
    eh_proj = tuple(on_disk(f"{name}.eh_proj") for name, proj in mtp if id(proj) in adapted)
    return AdapterTraits(rank, alpha, rslora, kv_b, shared, frozenset(projections), mtp_layers, eh_proj,
                         frozenset(leaves))


def engine_facts(name: str) -> EngineFacts:
    if name not in ENGINES:
        raise ValueError(f"--engine {name}: no deployment facts for this engine; choose from {sorted(ENGINES)}")
    return ENGINES[name]


def refusals(engine: EngineFacts, traits: AdapterTraits, layout: str) -> list[str]:
    """One line per way `engine` would apply the adapter differently from training, or not load it, each
    with its fix."""
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
    if traits.mtp_layers and not engine.loads_mtp_layer:
        out.append(f"the adapter holds LoRA tensors of the MTP layer ({_mtp_tensors(traits)}, trained with "
                   f"train.mtp_loss_weight > 0): {engine.name} {engine.checked} fails to load an adapter with "
                   f"MTP-layer tensors (the server does not start), and no engine applies an adapter to its MTP "
                   f"draft model; {_MTP_WAY_OUT}")
    elif traits.mtp_eh_proj and not engine.loads_mtp_eh_proj:
        out.append(f"the adapter adapts the MTP layer's eh_proj ({', '.join(traits.mtp_eh_proj)}, peft.target_modules "
                   f"\"*.eh_proj\"): {engine.name} {engine.checked} refuses such an adapter (eh_proj is no module "
                   f"of the model it adapts), and no engine applies an adapter to its MTP draft model; "
                   f"{_MTP_WAY_OUT}, or without \"*.eh_proj\" (then {engine.name} loads it but drafts with the "
                   "base MTP layer)")
    return out


_MERGE = ("to serve the trained drafter, merge it into the base (glmtune merge BASE_DIR RUN_DIR/adapter OUT_DIR) "
          "and serve OUT_DIR with the engine's MTP speculative decoding")
_MTP_WAY_OUT = (f"{_MERGE}; to serve an adapter, train without the MTP loss (train.mtp_loss_weight 0) or without "
                "MTP targets (peft.exclude_modules [\"mtp.*\"])")


def _mtp_tensors(traits: AdapterTraits) -> str:
    return ", ".join(f"{layer}.*" for layer in traits.mtp_layers)


def _mtp_loaded(engine: EngineFacts, traits: AdapterTraits) -> bool:
    return engine.loads_mtp_layer and (engine.loads_mtp_eh_proj or not traits.mtp_eh_proj)


def caveats(engine: EngineFacts, traits: AdapterTraits) -> list[str]:
    """What the engine applies differently, knowingly (a release records it, an export warns)."""
    out = []
    if traits.kv_b and not engine.applies_kv_b:
        out.append(f"{engine.name}'s MLA attention decodes with W_UK / W_UV precomputed from the base kv_b_proj "
                   "(absorbed), and its prefill (dense attention for prompts up to the indexer's top-k, 2048 tokens "
                   "on GLM-5) calls the base kv_b_proj layer its attention backend holds, not the LoRA-wrapped "
                   "module: this adapter's kv_b_proj delta is not applied (docs/lora.md; leave kv_b_proj out of "
                   "peft.target_modules, the default, for this engine)")
    if traits.mtp_layers and _mtp_loaded(engine, traits) and not engine.applies_mtp_layer:
        out.append(f"the adapter's MTP-layer tensors ({_mtp_tensors(traits)}, trained with train.mtp_loss_weight > 0) "
                   f"load but are never applied: {engine.name} {engine.checked} applies the decoder layers' adapters "
                   "only, and its MTP draft model (speculative decoding) runs the base MTP layer, not the trained "
                   f"drafter (docs/lora.md); {_MERGE}")
    return out


def serve_command(engine: EngineFacts, base: str, adapter: str | None, traits: AdapterTraits | None,
                  name: str = "adapter") -> list[str]:
    """The command line that serves `base` (with `adapter` as the LoRA named `name`) on `engine`, one
    argument per item (`shlex.join` it for a shell)."""
    if engine.name == "vllm":
        command = ["vllm", "serve", base]
        if adapter is not None:
            rank = next(r for r in VLLM_RANKS if r >= traits.rank)
            command += ["--enable-lora", "--lora-modules", lora_item(engine, name, adapter, base),
                        "--max-lora-rank", str(rank), "--max-loras", "1"]
        return command
    command = ["python", "-m", "sglang.launch_server", "--model-path", base]
    if adapter is not None:
        modules = sglang_target_modules(traits)
        command += ["--enable-lora", "--lora-paths", lora_item(engine, name, adapter, base),
                    "--max-lora-rank", str(traits.rank),
                    "--lora-target-modules", *modules]
        if traits.shared_experts or _sglang_wraps_moe(modules):
            command.append("--disable-shared-experts-fusion")
    return command


def lora_item(engine: EngineFacts, name: str, path: str, base: str) -> str:
    """The adapter's item of vLLM's --lora-modules or SGLang's --lora-paths: `NAME=PATH` when the
    engine reads that back as exactly `name` and `path`, else the JSON form each engine takes.

    vLLM 0.34 (entrypoints/common/cli_args.py LoRAParserAction) reads an item as NAME=PATH only when
    it holds `=` and no `,` (then splits at the first `=`), and any other item as JSON: a path with a
    `,` ("Invalid JSON format") or a name with `=` would be misread. SGLang 0.5.23 strips the item
    (arg_groups/argparse_actions.py LoRAPathAction), reads one that starts with `{` and ends with `}`
    as JSON, and splits the rest at the first `=` (arg_groups/lora_hook.py): a name with `=` or a
    path ending in a space would be misread. The plain form is kept for plain names and paths (what
    people type); anything else (`,` `=` braces, whitespace at either end, control characters) is
    JSON, which both read back exactly."""
    if _plain(name) and _plain(path):
        return f"{name}={path}"
    if engine.name == "vllm":
        return json.dumps({"name": name, "path": path, "base_model_name": base})
    return json.dumps({"lora_name": name, "lora_path": path})


def _plain(text: str) -> bool:
    return bool(text) and text.isprintable() and text == text.strip() and not set(text) & set(",={}")


def sglang_target_modules(traits: AdapterTraits) -> list[str]:
    """SGLang's --lora-target-modules for the adapter: the names its config lists (which SGLang requires
    the list to cover), plus both expert projections' when routed experts are adapted: SGLang wraps an MoE
    layer only when gate_up_proj and down_proj are both targets (lora_manager.py init_lora_modules), and
    otherwise drops a one-projection expert adapter silently; the other projection's LoRA buffers stay zero.
    Never `all`: SGLang resolves it from the model and, with the DSA indexer fused (NVIDIA, GLM-5's
    indexer_rope_interleave), refuses the indexer's wq_b at start-up (lora_manager.py init_lora_shapes)."""
    assert traits.modules, "an adapter adapts at least one module"
    modules = set(traits.modules)
    if traits.expert_projections:
        modules.update(leaf for leaves in EXPERT_LEAVES.values() for leaf in leaves)
    refused = modules - set(SGLANG_TARGET_MODULES)  # eh_proj only (an adapted MTP layer, refused for SGLang)
    assert not refused, f"--lora-target-modules accepts none of {sorted(refused)}"
    return sorted(modules)


def _sglang_wraps_moe(modules: list[str]) -> bool:
    """Whether SGLang wraps the MoE layers with LoRA (gate_up_proj and down_proj both targets, whatever
    module supplies the names): fused with the shared expert, such a layer has 257 expert slots against
    LoRA buffers of 256 experts (lora/mem_pool.py), which the MoE LoRA runners refuse (lora/moe/runner.py
    MoeLoraRunner._admit: "without fused shared experts")."""
    return bool({"gate_proj", "up_proj"} & set(modules)) and "down_proj" in modules
