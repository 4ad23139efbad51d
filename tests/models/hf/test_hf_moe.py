"""A MoE model's experts named as transformers stores them (models/hf/state_dict_adapter.py): the
stacked `mlp.experts.gate_up_proj` / `down_proj` parameters split into the per-expert tensors of
transformers' own `save_pretrained`, byte for byte, and read back into their slabs; so `glmtune
inspect --verify` checks a Qwen3-MoE directory tensor by tensor (it said "does not map MoE experts
yet", exit 1), and the sharded load fills an FSDP2 MoE model on 2 gloo ranks as one process's load
does (it refused a MoE model). A conversion of another kind in transformers' table is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from glmtune.checkpoint.hf_verify import verify_checkpoint
from glmtune.cli import main
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.hf.args import HfArgs
from glmtune.models.hf.spec import HF
from tests.distributed.gloo_helpers import run_gloo
from tests.models.hf.conftest import write_checkpoint
from tests.models.hf.test_hf_parallelize import _rank_step, _row, _supervised

EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    write_checkpoint("qwen3_moe", directory)
    return directory


def test_experts_are_named_as_transformers_saves_them(moe_dir):
    args = HF.architecture.args_from_hf(moe_dir)
    adapter = HF.weights.state_dict_adapter(args)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    state, on_disk = model.state_dict(), load_file(moe_dir / "model.safetensors")
    ours = {hf_key: part for key, tensor in state.items() for hf_key, part in adapter.to_hf(key, tensor)}
    assert ours.keys() == on_disk.keys() and len(on_disk) > len(state)
    for hf_key, tensor in on_disk.items():
        assert torch.equal(ours[hf_key], tensor), hf_key
        target = adapter.from_hf_key(hf_key)
        slab = state[target.key] if target.expert is None else state[target.key][target.expert]
        slab = slab if target.rows is None else slab[target.rows[0] : target.rows[1]]
        assert torch.equal(slab, tensor), hf_key
    assert adapter.from_hf_key(EXPERT).rows == (32, 64)  # up_proj: the second half of gate_up_proj's rows
    assert adapter.from_hf_key(EXPERT.replace(".3.", ".4.")) is None  # past the 4 experts


def test_inspect_verify_checks_a_moe_directory(moe_dir, tmp_path, capsys):
    report = verify_checkpoint(moe_dir, HF.hf_format)
    assert report.ok, [str(p) for p in report.problems]
    assert report.num_tensors == report.num_expected == len(load_file(moe_dir / "model.safetensors"))
    assert main(["inspect", str(moe_dir), "--verify"]) == 0
    assert f"{moe_dir}: OK" in capsys.readouterr().out

    bad = tmp_path / "bad"
    shutil.copytree(moe_dir, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors[EXPERT]
    tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = \
        tensors["model.layers.0.mlp.experts.1.down_proj.weight"][:8].clone()
    tensors[EXPERT.replace(".3.", ".7.")] = tensors["model.layers.1.mlp.experts.2.up_proj.weight"].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    found = [str(p) for p in verify_checkpoint(bad, HF.hf_format).problems]
    assert f"model.safetensors: {EXPERT}: missing" in found
    assert "model.safetensors: model.layers.0.mlp.experts.1.down_proj.weight: shape (8, 32), expected (64, 32)" in found
    assert any(m.startswith(f"model.safetensors: {EXPERT.replace('.3.', '.7.')}: unexpected") for m in found)
    assert main(["inspect", str(bad), "--verify"]) == 1


def test_a_conversion_of_another_kind_is_refused_by_name(moe_dir):
    config = {**json.loads((moe_dir / "config.json").read_text()), "model_type": "phimoe",
              "architectures": ["PhimoeForCausalLM"]}  # transformers renames .block_sparse_moe. to .mlp.
    with pytest.raises(ValueError, match=r"PhimoeForCausalLM: transformers converts its checkpoint tensors with "
                                         r"WeightRenaming \['.block_sparse_moe.'\] -> \['.mlp.'\], which the hf "
                                         "family's state-dict adapter does not map yet"):
        HF.weights.state_dict_adapter(HfArgs.from_config_dict(config, "config.json"))


def test_sharded_load_of_a_moe_model_on_two_ranks_equals_one_process(tmp_path):
    """tests/models/hf/test_hf_parallelize.py's step on 2 gloo ranks, the MoE model built on meta
    and filled by `HF.weights.load_sharded`: loss and every gradient equal one process's, and the export of
    the sharded model holds the weights loaded."""
    directory = tmp_path / "qwen3_moe"
    write_checkpoint("qwen3_moe", directory)
    out = tmp_path / "rank0.safetensors"
    run_gloo(_rank_step, 2, tmp_path, str(directory), str(out), True)
    sharded = load_file(out)
    model = HF.weights.load_pretrained(directory, torch.float32, "cpu")
    rows = [_row(0), _row(1)]
    both = {key: torch.cat([row[key] for row in rows]) for key in rows[0]}
    loss_sum, _ = HF.compute.loss(model, MicroBatch(**both))
    (loss_sum / sum(_supervised(row) for row in rows)).backward()
    torch.testing.assert_close(sharded["loss_sum"], loss_sum.detach(), rtol=1e-6, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(sharded[f"grad.{name}"], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert load_file(tmp_path / "export" / "model.safetensors").keys() == load_file(directory / "model.safetensors").keys()
