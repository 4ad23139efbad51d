"""HF checkpoint I/O: sharding, MTP kept, FP8 dequantized, and one-line errors for bad input."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import load_pretrained, save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME, check_complete, checkpoint_files, read_plan
from glmtune.models.glm5.args import Glm5Args, get_preset
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.spec import GLM5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = build_model(get_preset("tiny"), seed=0)
    with torch.no_grad():
        model.mtp[0].eh_proj.weight.normal_()  # make MTP weights distinctive
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_pretrained(model, path, max_shard_size="300KB")
    return model, path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_sharded_save_and_load_round_trip(tiny_dir):
    model, path = tiny_dir
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in index["weight_map"]
    # MTP layer = layer index num_hidden_layers on disk, kept through the round trip.
    assert "model.layers.4.eh_proj.weight" in index["weight_map"]
    assert "model.layers.4.mlp.experts.0.gate_proj.weight" in index["weight_map"]
    loaded = load_pretrained(path, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_truncated_shard_is_one_line_error(tiny_dir, tmp_path):
    _, path = tiny_dir
    bad = _copy(path, tmp_path / "bad")
    shard = sorted(bad.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=rf"{shard.name}: truncated") as info:
        load_pretrained(bad, dtype=torch.float32)
    assert "\n" not in str(info.value)


def test_missing_shard_names_file(tiny_dir, tmp_path):
    _, path = tiny_dir
    bad = _copy(path, tmp_path / "bad")
    shard = sorted(bad.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_pretrained(bad, dtype=torch.float32)


@pytest.mark.parametrize("name", [INDEX_NAME, "model.safetensors"])
def test_a_fifo_for_the_weights_is_said_to_be_one(tmp_path, name):
    """Never opened (it would wait for a writer forever), and named for what it is (issue 44, M6)."""
    path = tmp_path / "fifo"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    os.mkfifo(path / name)
    with pytest.raises(ValueError, match=rf"{name}\b.*is a FIFO \(named pipe\), not a regular file"):
        load_pretrained(path, dtype=torch.float32)


def _rewrite_shard(path, edit):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = index["weight_map"]["model.norm.weight"]
    tensors = load_file(path / name)
    tensors = edit(tensors)
    save_file(tensors, path / name, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != name}
    index["weight_map"].update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return name


def test_missing_unexpected_and_misshaped_keys(tiny_dir, tmp_path):
    _, path = tiny_dir
    missing = _copy(path, tmp_path / "missing")
    _rewrite_shard(missing, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="model.safetensors.index.json: model.norm.weight: missing"):
        load_pretrained(missing, dtype=torch.float32)

    unexpected = _copy(path, tmp_path / "unexpected")
    name = _rewrite_shard(unexpected, lambda t: {**t, "model.layers.9.mlp.gate.weight": torch.zeros(8, 128)})
    with pytest.raises(ValueError, match=rf"{name}: model.layers.9.mlp.gate.weight: unexpected tensor"):
        load_pretrained(unexpected, dtype=torch.float32)

    misshaped = _copy(path, tmp_path / "misshaped")
    name = _rewrite_shard(misshaped, lambda t: {**t, "model.norm.weight": torch.ones(7)})
    with pytest.raises(ValueError, match=rf"{name}: model.norm.weight: shape \(7,\), expected \(128,\)"):
        load_pretrained(misshaped, dtype=torch.float32)


def _quantize_blockwise(weight: torch.Tensor):
    """Reference FP8 quantizer written independently: explicit loops over 128x128 blocks."""
    rows, cols = weight.shape
    nb_r, nb_c = -(-rows // 128), -(-cols // 128)
    scale = torch.empty(nb_r, nb_c)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    expected = torch.empty(rows, cols)
    for i in range(nb_r):
        for j in range(nb_c):
            block = weight[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = block.abs().max().clamp_min(1e-12) / 448.0
            scale[i, j] = s
            qb = (block / s).to(torch.float8_e4m3fn)
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = qb
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = qb.float() * s
    return q, scale, expected


def test_fp8_checkpoint_is_dequantized(tmp_path):
    args = get_preset("tiny").replace(hidden_size=256, q_lora_rank=192)  # several 128-blocks, a partial one
    model = build_model(args, seed=1)
    path = save_pretrained(model, tmp_path / "bf16")
    tensors = load_file(path / "model.safetensors")
    expected = {}
    for key in list(tensors):
        w = tensors[key]
        if w.dim() == 2 and key.endswith("proj.weight") and "weights_proj" not in key:
            q, scale, expected[key] = _quantize_blockwise(w)
            tensors[key] = q
            tensors[key + "_scale_inv"] = scale
    assert "model.layers.0.self_attn.q_b_proj.weight" in expected
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_pretrained(path, dtype=torch.float32)
    state = loaded.state_dict()
    assert torch.equal(state["model.layers.0.self_attn.q_b_proj.weight"],
                       expected["model.layers.0.self_attn.q_b_proj.weight"])
    assert torch.equal(state["model.layers.2.mlp.experts.gate_up_proj"][3, args.moe_intermediate_size:],
                       expected["model.layers.2.mlp.experts.3.up_proj.weight"])
    # A wrong scale grid is reported with the key and the file.
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(5, 5)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors: model.layers.0.self_attn.o_proj.weight_scale_inv: shape \(5, 5\), expected \(2, 1\)"):
        load_pretrained(path, dtype=torch.float32)


def test_save_is_atomic_and_copies_tokenizer(tiny_dir, tmp_path):
    model, path = tiny_dir
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "chat_template.jinja").write_text("{{ messages }}")
    out = save_pretrained(model, tmp_path / "out", source_dir=tmp_path / "src")
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    # Overwriting an existing export replaces it whole.
    save_pretrained(model, out)
    assert not (out / "chat_template.jinja").exists()


def test_more_experts_on_disk_than_in_config_is_named(tiny_dir, tmp_path):
    _, path = tiny_dir
    bad = _copy(path, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["n_routed_experts"] = 4
    config["n_group"] = 1
    config["topk_group"] = 1
    (bad / "config.json").write_text(json.dumps(config))
    # A one-line ValueError naming the file and a tensor (router or expert), never an IndexError.
    with pytest.raises(ValueError, match=r"safetensors: model\.layers\.[23]\.mlp\.\S+: (shape|unexpected)"):
        load_pretrained(bad, dtype=torch.float32)
    adapter = GLM5.weights.state_dict_adapter(Glm5Args.from_hf_config(bad))
    assert adapter.from_hf_key("model.layers.2.mlp.experts.4.down_proj.weight") is None
    assert adapter.from_hf_key("model.layers.2.mlp.experts.3.down_proj.weight").expert == 3


def test_the_missing_tensor_named_is_the_one_missing(tiny_dir):
    """`check_complete` (the loaders' and the streaming merge's completeness check) names the HF
    tensor that is absent, one expert's projection of a stacked expert tensor included, and counts
    every absent one."""
    model, path = tiny_dir
    files = checkpoint_files(path)
    absent = ["model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.3.mlp.experts.7.down_proj.weight"]
    adapter = GLM5.weights.state_dict_adapter(model.args)
    state = model.state_dict()
    plan = read_plan({key: file for key, file in files.items() if key not in absent}, adapter, state.keys())
    shapes = {key: tuple(tensor.shape) for key, tensor in state.items()}
    with pytest.raises(ValueError, match=rf"^checkpoint is missing tensor {absent[0]} \(and 1 more\)$"):
        check_complete(shapes, plan, adapter)
    check_complete(shapes, read_plan(files, adapter, state.keys()), adapter)  # the whole checkpoint: complete


def test_fp32_master_weights_export_in_the_compute_dtype(tiny_dir, tmp_path):
    """Under fp32 master weights the parameters are fp32 but the run computes in bf16 (model.dtype):
    save_pretrained(dtype=bfloat16) writes what a bf16 model holding the rounded weights writes,
    and transformers loads it as bf16 with the fp32 weights rounded to bf16 (routers fp32, exact)."""
    from transformers import AutoModelForCausalLM

    model, _ = tiny_dir  # fp32 parameters
    out = save_pretrained(model, tmp_path / "bf16", max_shard_size="300KB", dtype=torch.bfloat16)
    # What a bf16 model (routers fp32, as build_model keeps them) with these weights writes.
    bf16 = build_model(get_preset("tiny"), torch.bfloat16, init=False)
    bf16.load_state_dict(model.state_dict())  # copy_ rounds to each parameter's dtype
    reference = save_pretrained(bf16, tmp_path / "reference", max_shard_size="300KB")
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # Shards sized as written (bf16), not as held (fp32): the same files as the bf16 model's.
    assert index == json.loads((reference / "model.safetensors.index.json").read_text())
    for name in sorted(set(index["weight_map"].values())):
        written, expected = load_file(out / name), load_file(reference / name)
        assert written.keys() == expected.keys()
        for key, tensor in expected.items():
            assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key

    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert hf.dtype == torch.bfloat16
    fp32 = model.state_dict()  # transformers holds the experts stacked, as glmtune does
    loaded = hf.state_dict()
    assert len(loaded) > 50 and loaded.keys() <= fp32.keys()  # the MTP layer is glmtune's only
    rounded = 0
    for key, tensor in loaded.items():
        router = key.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        expected = fp32[key].to(torch.float32 if router else torch.bfloat16)
        assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), key
        rounded += int(not torch.equal(expected.float(), fp32[key]))
    assert rounded > 20  # the fp32 weights are not bf16-exact: the cast is real
