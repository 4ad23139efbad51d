"""An adapter applied unmerged (LoRA modules holding its weights) computes what the merged model
computes, from either export layout: the two forms `glmtune eval --merged` compares."""

from __future__ import annotations

import torch

from glmtune import load_pretrained
from glmtune.peft.adapter_load import apply_adapter
from glmtune.peft.lora import lora_modules
from glmtune.peft.merge import merge_adapter_dir
from tests.train.run_helpers import TWO_STEPS, shared_run


def test_unmerged_adapter_matches_the_merged_model(shared_results):
    run_dir = shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir  # test_run_e2e's
    ids = torch.randint(0, 4000, (2, 24), generator=torch.Generator().manual_seed(0))

    def logits(model):
        with torch.no_grad():
            return model.eval()(ids).logits

    base = logits(load_pretrained(run_dir / "base", torch.float32))
    merged = load_pretrained(run_dir / "base", torch.float32)
    merge_adapter_dir(merged, run_dir / "adapter")
    expected = logits(merged)
    assert (expected - base).abs().max() > 1e-3  # two steps moved the adapters off zero
    for layout in ("adapter", "adapter_per_expert"):
        model = load_pretrained(run_dir / "base", torch.float32)
        assert apply_adapter(model, run_dir / layout).modules == len(lora_modules(model)) > 0
        assert not any(p.requires_grad for p in model.parameters())
        assert (logits(model) - expected).abs().max() < 1e-4, layout
