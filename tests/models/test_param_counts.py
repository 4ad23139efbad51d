"""Parameter counts (meta device) and parameter-group classification for GLM-5."""

from __future__ import annotations

import pytest

from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.counts import layer_runs, parameter_report
from glmtune.models.glm5.param_groups import GROUPS, count_by_group, param_group


@pytest.fixture(scope="module")
def glm5_report():
    return parameter_report(get_preset("glm5"))


def test_glm5_totals_exact(glm5_report):
    # docs/glm5-architecture.md §7 and docs/params.py
    assert glm5_report["total_params"] == 743_911_199_232
    assert glm5_report["total_params_with_mtp"] == 753_864_119_552
    assert glm5_report["mtp_params"] == 753_864_119_552 - 743_911_199_232
    assert glm5_report["buffers"] == {"e_score_correction_bias": 19_200, "e_score_correction_bias_mtp": 256}


def test_glm5_active_exact(glm5_report):
    assert glm5_report["active_params"] == 40_833_126_912  # headline: excl. input embedding
    assert round(glm5_report["active_params"] / 1e9, 2) == 40.83
    assert glm5_report["active_params_incl_embedding"] == 41_784_709_632
    assert glm5_report["active_params_excl_embedding_and_head"] == 39_881_544_192


def test_glm5_groups(glm5_report):
    groups = glm5_report["params_by_group"]
    assert list(groups) == list(GROUPS)
    assert sum(groups.values()) == glm5_report["total_params_with_mtp"]
    assert groups["attention"] == 78 * 165_022_208  # MLA, its q_a/kv_a latent norms included
    assert groups["indexer"] == 78 * 9_371_904
    assert groups["dense_mlp"] == 3 * 226_492_416
    assert groups["routed_experts"] == 75 * 256 * 37_748_736
    assert groups["shared_experts"] == 75 * 37_748_736
    assert groups["router"] == 75 * 256 * 6144
    assert groups["norms"] == 78 * 2 * 6144 + 6144
    assert groups["embeddings"] == groups["head"] == 154_880 * 6144
    active = glm5_report["active_params_by_group"]
    assert active["routed_experts"] == 75 * 8 * 37_748_736
    assert active["mtp"] == 0


def test_glm5_layer_table(glm5_report):
    layers = glm5_report["layers"]
    assert len(layers) == 79
    assert [(r["index"], r["mlp"], r["indexer"], r["mtp"]) for r in (layers[0], layers[3], layers[78])] == [
        (0, "dense", "full", False), (3, "moe", "full", False), (78, "moe", "full", True)]
    labels = [run["label"] for run in glm5_report["layer_runs"]]
    assert labels == ["0–2: dense, full", "3–77: MoE, full", "78: MoE, full (MTP)"]
    assert sum(r["params"] for r in layers if not r["mtp"]) + glm5_report["params_by_group"]["embeddings"] \
        + glm5_report["params_by_group"]["head"] + 6144 == glm5_report["total_params"]


def test_glm52_counts():
    report = parameter_report(get_preset("glm5.2"))
    assert report["total_params"] == 743_377_000_704
    assert report["total_params_with_mtp"] == 753_329_921_024
    assert round(report["total_params"] / 1e9, 2) == 743.38
    assert round(report["total_params_with_mtp"] / 1e9, 2) == 753.33
    assert report["active_params"] == 40_298_928_384
    full = [r["index"] for r in report["layers"] if r["indexer"] == "full" and not r["mtp"]]
    assert len(full) == 21 and full[:5] == [0, 1, 2, 6, 10] and full[-1] == 74
    assert report["params_by_group"]["indexer"] == 21 * 9_371_904


def test_tiny_report_consistent_with_model():
    args = get_preset("tiny")
    report = parameter_report(args)
    model = build_model(args, device="meta")
    assert report["total_params_with_mtp"] == sum(p.numel() for p in model.parameters())
    assert report["params_by_group"] == count_by_group(model)
    labels = [run["label"] for run in report["layer_runs"]]
    assert labels == ["0: dense, full", "1: dense, shared", "2: MoE, full", "3: MoE, shared", "4: MoE, full (MTP)"]


def test_tied_embeddings_counted_once():
    args = get_preset("tiny").replace(tie_word_embeddings=True)
    report = parameter_report(args)
    untied = parameter_report(get_preset("tiny"))
    assert report["params_by_group"]["head"] == 0
    assert report["total_params"] == untied["total_params"] - args.vocab_size * args.hidden_size
    # The shared matrix is the head, so the headline keeps it.
    assert report["active_params"] == report["active_params_incl_embedding"]
    assert report["active_params_excl_embedding_and_head"] == untied["active_params_excl_embedding_and_head"]


def test_layer_runs_merge_only_adjacent_identical():
    rows = [{"index": i, "mlp": "moe", "indexer": kind, "mtp": False, "params": 1, "active_params": 1}
            for i, kind in enumerate(["full", "full", "shared", "full"])]
    assert [r["label"] for r in layer_runs(rows)] == ["0–1: MoE, full", "2: MoE, shared", "3: MoE, full"]


@pytest.mark.parametrize("name, group", [
    ("model.embed_tokens.weight", "embeddings"),
    ("lm_head.weight", "head"),
    ("model.norm.weight", "norms"),
    ("model.layers.5.input_layernorm.weight", "norms"),
    ("model.layers.5.post_attention_layernorm.weight", "norms"),
    ("model.layers.5.self_attn.q_a_proj.weight", "attention"),
    ("model.layers.5.self_attn.q_a_layernorm.weight", "attention"),
    ("model.layers.5.self_attn.kv_a_layernorm.weight", "attention"),
    ("model.layers.5.self_attn.o_proj.weight", "attention"),
    ("model.layers.5.self_attn.indexer.k_norm.bias", "indexer"),
    ("model.layers.5.self_attn.indexer.weights_proj.weight", "indexer"),
    ("model.layers.5.mlp.gate.weight", "router"),
    ("model.layers.5.mlp.gate.e_score_correction_bias", "router"),
    ("model.layers.5.mlp.experts.gate_up_proj", "routed_experts"),
    ("model.layers.5.mlp.experts.down_proj", "routed_experts"),
    ("model.layers.5.mlp.experts.17.gate_proj.weight", "routed_experts"),  # HF on-disk key
    ("model.layers.5.mlp.shared_experts.up_proj.weight", "shared_experts"),
    ("model.layers.1.mlp.gate_proj.weight", "dense_mlp"),
    ("model.layers.1.mlp.down_proj.weight", "dense_mlp"),
    ("mtp.0.eh_proj.weight", "mtp"),
    ("mtp.0.mlp.experts.gate_up_proj", "mtp"),
    ("mtp.0.shared_head.norm.weight", "mtp"),
    # LoRA and wrapper names classify with their base module.
    ("model.layers.5.self_attn.q_a_proj.lora_A.weight", "attention"),
    ("model.layers.5.self_attn.kv_b_proj.lora_B.default.weight", "attention"),
    ("model.layers.5.mlp.experts.lora_gate_up_A", "routed_experts"),
    ("model.layers.5.mlp.experts.lora_down_B", "routed_experts"),
    ("model.layers.5.mlp.shared_experts.gate_proj.base_layer.weight", "shared_experts"),
    ("base_model.model.lm_head.lora_A.weight", "head"),
    ("_orig_mod.model.layers.0.mlp._checkpoint_wrapped_module.up_proj.weight", "dense_mlp"),
    ("base_model.model.mtp.0.self_attn.q_b_proj.lora_A.weight", "mtp"),
])
def test_param_group(name, group):
    assert param_group(name) == group


@pytest.mark.parametrize("name", ["model.layers.3.mlp.tokens_per_expert", "foo.bar", "model.layers.3.weight"])
def test_param_group_unknown_raises(name):
    with pytest.raises(ValueError, match="cannot classify"):
        param_group(name)


def test_count_by_group_trainable_only():
    model = build_model(get_preset("tiny"), device="meta")
    trainable = count_by_group(model, trainable_only=True)
    everything = count_by_group(model)
    # Indexers and MTP are frozen by default; everything else trains.
    assert trainable["indexer"] == 0 and trainable["mtp"] == 0
    assert {g: n for g, n in trainable.items() if g not in ("indexer", "mtp")} == {
        g: n for g, n in everything.items() if g not in ("indexer", "mtp")}
