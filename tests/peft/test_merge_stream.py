"""`glmtune merge` shard by shard (glmtune/peft/merge_stream.py): the same files, bit for bit,
as loading the base whole, merging and saving it (the in-memory path merge_to_dir used
before), for a bf16 and an FP8 base, both adapter layouts, with and without --fp8, base and
output in several shards; and a ~1 GB checkpoint merged in a subprocess whose peak RSS stays
under the interpreter's own baseline + the largest input shard (its mapped pages) + twice the
largest output shard (the shard held until written, and as much again for the allocator: freed
temporaries between the shard's tensors) + twice the adapter file (its factors held in fp32) +
a fixed slack, where the in-memory path needs the model twice."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import load_pretrained, save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.cli import main
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model
from glmtune.peft import apply_lora, export_adapter
from glmtune.peft.merge import _requantize, config_dtype, merge_adapter_dir, merge_to_dir
from tests.checkpoint.test_fp8_base_load import _fp8_checkpoint
from tests.peak_rss import PEAK, peak_rss
from tests.peft.conftest import lora_cfg, randomize_adapters

# The FP8 fixture's shapes: 128-row expert halves, a partial 128-block (q_lora_rank 192).
ARGS = dict(hidden_size=256, q_lora_rank=192, moe_intermediate_size=128)


def _in_memory_merge(base, adapter, out, max_shard_size, fp8):
    """merge_to_dir as it was: the whole base loaded, merged, re-quantized, saved."""
    model = load_pretrained(base, config_dtype(Path(base)), "cpu", "eager", "loop")
    merge_adapter_dir(model, adapter)
    if fp8:
        print(_requantize(model))
    save_pretrained(model, out, max_shard_size=max_shard_size, source_dir=base, overwrite=False,
                    sources=(("BASE_DIR", base), ("ADAPTER_DIR", adapter)))


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A bf16 base in 300 KB shards (tokenizer files alongside) and an FP8 base (one file)."""
    root = tmp_path_factory.mktemp("stream-bases")
    bf16 = save_pretrained(build_model(get_preset("tiny").replace(**ARGS), seed=1), root / "bf16",
                           max_shard_size="300KB", dtype=torch.bfloat16)
    (bf16 / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    fp8, _ = _fp8_checkpoint(root / "fp8")
    return {"bf16": bf16, "fp8": fp8}


@pytest.mark.parametrize("base_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["peft", "per_expert"])
def test_streaming_merge_is_bit_identical_to_the_in_memory_merge(bases, base_kind, layout, tmp_path, capsys):
    base = bases[base_kind]
    model = load_pretrained(base, dtype=torch.float32, attention_backend="eager")
    apply_lora(model, lora_cfg(exclude_modules=["model.layers.3.mlp.experts.gate_up_proj"]))
    randomize_adapters(model, seed=3)
    adapter = export_adapter(model, tmp_path / "adapter", layout=layout)
    for fp8 in (False, True):
        for size in ("5GB", "1MB"):
            old, new = tmp_path / f"old-{fp8}-{size}", tmp_path / f"new-{fp8}-{size}"
            capsys.readouterr()
            _in_memory_merge(base, adapter, old, size, fp8)
            old_out = capsys.readouterr().out
            merge_to_dir(base, adapter, new, max_shard_size=size, fp8=fp8)
            assert capsys.readouterr().out == old_out
            assert _digests(new) == _digests(old), (fp8, size)
            if size == "1MB":
                assert len(json.loads((new / INDEX_NAME).read_text())["weight_map"]) > 0
                assert len(list(new.glob("model-*.safetensors"))) > 2
            if fp8:
                assert old_out.startswith("re-quantized ") and old_out.count("\n") == 1
                assert "quantization_config" in json.loads((new / "config.json").read_text())
    assert (new / "tokenizer_config.json").exists() == (base_kind == "bf16")


def test_streaming_merge_keeps_the_refusals(bases, tmp_path, capsys):
    base = bases["bf16"]
    model = load_pretrained(base, dtype=torch.float32, attention_backend="eager")
    apply_lora(model, lora_cfg(target_modules=["*.o_proj"]))
    adapter = export_adapter(model, tmp_path / "adapter")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        merge_to_dir(base, adapter, out)
    with pytest.raises(ValueError, match="is inside BASE_DIR"):
        merge_to_dir(base, adapter, base / "merged", overwrite=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        merge_to_dir(base, adapter, out, overwrite=True)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("lora_B.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="o_proj gives a delta of shape"):
        merge_to_dir(base, adapter, out, overwrite=True)
    assert main(["merge", str(base), str(tmp_path / "missing"), str(out), "--overwrite"]) == 2
    assert (out / "keep.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["adapter", "out"]


# ~1 GB in bf16: 3 MoE layers of 80 experts, 1024 wide.
BIG = dict(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=80, first_k_dense_replace=1)
SLACK = 256 << 20  # one unit's fp32 temporaries, allocator slack, the meta models and plans
_BASELINE = "import torch, glmtune.peft.merge, glmtune.cli.merge_cmd; " + PEAK


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A ~1 GB bf16 base in 128 MB shards and a LoRA adapter on every projection and expert."""
    root = tmp_path_factory.mktemp("big")
    model = build_model(get_preset("tiny").replace(**BIG), torch.bfloat16, init=False)
    tile = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) - 0.5  # cheaper than 500M draws
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            flat = param.view(-1)
            for start in range(0, flat.numel(), tile.numel()):
                part = flat[start : start + tile.numel()]
                part.copy_(tile.roll(i)[: part.numel()])
    base = save_pretrained(model, root / "base", max_shard_size="128MB")
    apply_lora(model, lora_cfg())
    randomize_adapters(model, scale=0.01)
    adapter = export_adapter(model, root / "adapter")
    return base, adapter


@pytest.fixture(scope="module")
def baseline_rss() -> int:
    """The peak RSS of an interpreter that imported the merge and stopped: both merges' baseline."""
    return peak_rss(_BASELINE)


def test_merging_1gb_stays_under_the_shard_bound(big_checkpoint, baseline_rss, tmp_path):
    base, adapter = big_checkpoint
    shards = list(base.glob("*.safetensors"))
    base_bytes = sum(f.stat().st_size for f in shards)
    assert base_bytes > 900e6 and len(shards) >= 7
    out = tmp_path / "merged"
    baseline = baseline_rss
    peak = peak_rss(f"from glmtune.peft.merge import merge_to_dir; "
                     f"merge_to_dir({str(base)!r}, {str(adapter)!r}, {str(out)!r}, max_shard_size='64MB'); " + PEAK)
    written = list(out.glob("*.safetensors"))
    largest_in, largest_out = max(f.stat().st_size for f in shards), max(f.stat().st_size for f in written)
    adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    bound = baseline + largest_in + 2 * largest_out + 2 * adapter_bytes + SLACK
    print(f"peak RSS {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB, base {base_bytes / 2**20:.0f} "
          f"MiB, bound {bound / 2**20:.0f} MiB")
    assert peak < bound, (peak, bound)
    assert peak - baseline < base_bytes / 2  # the in-memory merge needed about twice the base


# --fp8: each unit is also dequantized and re-quantized per 128 x 128 block in fp32, and the
# e4m3 parts the shard holds (half a bf16 part each) sit between those temporaries in glibc's
# heap: measured 470 MiB over the interpreter's own (bf16: 315 MiB), the excess fragmentation
# (a 256 KB mmap threshold, or malloc_trim after each unit, brings it to about 260 MiB).
FP8_SLACK = 512 << 20


def test_merging_1gb_with_fp8_stays_under_the_shard_bound(big_checkpoint, baseline_rss, tmp_path):
    base, adapter = big_checkpoint
    shards = list(base.glob("*.safetensors"))
    base_bytes = sum(f.stat().st_size for f in shards)
    out = tmp_path / "merged-fp8"
    baseline = baseline_rss
    peak = peak_rss(f"from glmtune.peft.merge import merge_to_dir; merge_to_dir({str(base)!r}, {str(adapter)!r}, "
                     f"{str(out)!r}, max_shard_size='64MB', fp8=True); " + PEAK)
    written = list(out.glob("*.safetensors"))
    largest_in, largest_out = max(f.stat().st_size for f in shards), max(f.stat().st_size for f in written)
    adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    bound = baseline + largest_in + 2 * largest_out + 2 * adapter_bytes + FP8_SLACK
    print(f"--fp8: peak RSS {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB, base "
          f"{base_bytes / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert peak < bound, (peak, bound)
    assert peak - baseline < base_bytes  # the in-memory merge with --fp8 took 3.0 GiB here (9e101df)
