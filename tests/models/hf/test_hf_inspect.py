"""`glmtune inspect DIR` of an hf-family directory (it refused: "the hf family does not do the per-layer
parameter report yet"): the summary, the parameter report and the layer runs from config.json's shapes
(models/hf/summary.py over memory_layout.py's count), equal to transformers' own model: every
parameter by the spec's groups, per decoder layer, and active per token (a MoE layer's top-k of its
experts, counted here from the model's stacked expert tensors); a tied head counted once. The
tables and `--json` print them, and `--verify` reports beside them."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from glmtune.cli import main
from glmtune.models.hf.spec import HF
from tests.models.hf.conftest import CONFIGS


def _real(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, local_files_only=True)


def test_the_report_counts_transformers_model(tiny_dir):
    args = HF.architecture.args_from_hf(tiny_dir)
    model = _real(tiny_dir)
    report = HF.architecture.parameter_report(args)
    by_group = dict.fromkeys(HF.architecture.param_groups, 0)
    for name, param in model.named_parameters():  # a tied head once, under the embedding
        by_group[HF.architecture.param_group(name)] += param.numel()
    assert report["params_by_group"] == by_group
    assert report["total_params"] == sum(p.numel() for p in model.parameters())
    layers = model.model.layers
    assert [row["params"] for row in report["layers"]] == [sum(p.numel() for p in layer.parameters()) for layer in layers]
    idle = [sum(p.numel() for p in layer.mlp.experts.parameters()) * (args.num_experts - args.num_experts_per_tok)
            // args.num_experts if i in args.moe_layers else 0 for i, layer in enumerate(layers)]
    assert [row["params"] - row["active_params"] for row in report["layers"]] == idle
    embedding = model.get_input_embeddings().weight.numel()
    assert report["active_params_incl_embedding"] == report["total_params"] - sum(idle)
    assert report["active_params"] == report["active_params_incl_embedding"] - embedding
    assert report["active_params_excl_embedding_and_head"] == report["active_params"] - embedding  # untied head
    assert sum(report["active_params_by_group"].values()) == report["active_params_incl_embedding"]
    kind = "MoE" if args.num_experts else "dense"
    assert HF.architecture.layer_runs(report["layers"]) == report["layer_runs"]
    assert [run["label"] for run in report["layer_runs"]] == [f"0–1: {kind}"]
    assert report["layout_known"]


def test_a_tied_head_is_counted_once_and_is_the_active_head(tmp_path):
    config = CONFIGS["qwen3"]()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    report = HF.architecture.parameter_report(HF.architecture.args_from_hf(tmp_path))
    model = _real(tmp_path)
    assert report["total_params"] == sum(p.numel() for p in model.parameters())
    assert report["params_by_group"]["head"] == 0
    assert report["active_params"] == report["active_params_incl_embedding"] == report["total_params"]


def test_inspect_prints_an_hf_directory(tiny_dir, capsys):
    args = HF.architecture.args_from_hf(tiny_dir)
    total = sum(p.numel() for p in _real(tiny_dir).parameters())
    assert main(["inspect", str(tiny_dir)]) == 0
    # rich wraps at the terminal's width (a long temporary path moves the break): compare words
    out = " ".join(capsys.readouterr().out.split())
    assert f"{args.architecture} ({args.model_type})" in out and f"{total:,}" in out
    assert ("MoE" in out and "4 experts (top-2)" in out) if args.num_experts else "dense MLP" in out
    assert main(["inspect", str(tiny_dir), "--verify", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["total_params"] == total and payload["verify"]["ok"] and "undescribed" not in payload
    assert payload["architecture"]["num_moe_layers"] == len(args.moe_layers)
