"""How the release is served: the engine's command line for the shipped artifacts, or a refusal.

`glmtune release --engine NAME==VERSION` names the engine that will serve the release. For an
engine in `glmtune.peft.engines.ENGINES` (vLLM, SGLang) the manifest's `engine` section gains
`serve_command` (the exact command: base + the per-expert adapter with the flags it needs, or the
full checkpoint), `facts_checked` (the engine version the facts were read from; a different
pinned version is recorded as such, not refused) and `caveats` (what the engine applies
differently, knowingly: a kv_b_proj delta vLLM applies in neither its absorbed decode nor its dense
prefill (both read the base layer its attention impl holds); the MTP layer's adapters
of a run with the MTP loss, which vLLM loads and never applies). An adapter the engine would apply
differently from training and silently (rsLoRA on SGLang, a routed-expert adapter on one
projection, a rank beyond the engine's limit, no per-expert layout) or would not load (MTP-layer
adapters on SGLang, an adapted MTP eh_proj on vLLM) is refused, one line with the fix, before
anything is written: `glmtune export --engine` refuses the same. Another engine is recorded by
name and version only.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import torch

from glmtune.models.registry import model_args, model_spec
from glmtune.peft import apply_lora
from glmtune.peft.engines import ENGINES, adapter_traits, caveats, refusals, serve_command


def deployment(engine: dict[str, str], cfg, run_dir: Path, base_dir: Path) -> dict[str, Any]:
    """The `engine` section's deployment fields for this run's artifacts (module docstring)."""
    facts = ENGINES.get(engine["name"])
    if facts is None:
        return {"serve_command": None, "facts_checked": None, "caveats": [],
                "note": f"glmtune holds no deployment facts for {engine['name']} (known: {', '.join(sorted(ENGINES))})"}
    if cfg.peft.method != "lora":
        command = serve_command(facts, str((run_dir / "hf").resolve()), None, None)
        return {"serve_command": shlex.join(command), "facts_checked": facts.checked, "caveats": []}
    spec = model_spec(cfg.model)
    model = spec.weights.build(model_args(cfg.model), getattr(torch, cfg.model.dtype), "meta")
    # a run with the MTP loss adapted its MTP layer too (glmtune/peft/apply.py): the same adapters here
    spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    apply_lora(model, cfg.peft)
    traits = adapter_traits(model, cfg.peft.rank, cfg.peft.alpha, cfg.peft.rslora)
    adapter = run_dir / "adapter_per_expert"
    layout = "per_expert" if adapter.is_dir() else "peft"
    refused = refusals(facts, traits, layout)
    if refused:
        raise ValueError(f"--engine {engine['name']}=={engine['version']}: " + "; ".join(refused))
    command = serve_command(facts, str(base_dir.resolve()), str(adapter.resolve()), traits)
    return {"serve_command": shlex.join(command), "facts_checked": facts.checked, "caveats": caveats(facts, traits)}
