"""`glmtune export RUN_DIR --hf OUT` (glmtune/checkpoint/export_stream.py) writes, bit for bit,
what save_pretrained writes for the model in memory: against the model that saved a one-process
checkpoint (fp32 master weights exported in bf16, routers kept fp32; tied and untied heads;
one shard and 300 KB shards, so expert slabs are read in several groups), and against the HF
export each of two real runs wrote at its end (RUN_DIR/hf; one process, and two ranks of gloo
FSDP2 whose checkpoint holds each rank's half). It keeps the refusals, and a ~1 GB checkpoint
exports in a subprocess whose peak RSS stays under the interpreter's own + twice the largest
output shard + one group of checkpoint tensors (--max-shard-size as stored) + the largest
stored tensor (DCP reads a stored chunk whole) + a fixed slack, where holding the model takes
the whole checkpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from glmtune import save_pretrained
from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.checkpoint.manager import CheckpointManager
from glmtune.cli import main
from glmtune.data.tokenizer import resolve_tokenizer_dir
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.spec import GLM5
from tests.peak_rss import PEAK, peak_rss
from tests.train.run_helpers import WITH_EXPORT, shared_run
from tests.tree_snapshot import changes, snapshot

ARGS = dict(hidden_size=256, q_lora_rank=192, moe_intermediate_size=128)


def _digests(path: Path) -> dict[str, str]:
    """The checkpoint's files; not the hidden output record, which names the command that wrote it."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if not p.name.startswith(".")}


def _save_checkpoint(model: torch.nn.Module, root: Path) -> Path:
    """A one-process checkpoint of `model` as the trainer saves it (SGD: no optimizer state to build)."""
    return CheckpointManager(root).save(3, model, torch.optim.SGD(model.parameters(), lr=0.0), {})


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_exports_as_save_pretrained_writes_the_model_it_holds(tmp_path, tied):
    args = get_preset("tiny").replace(**ARGS, tie_word_embeddings=tied)
    model = build_model(args, torch.float32, seed=1)  # fp32 master weights
    checkpoint = _save_checkpoint(model, tmp_path / "checkpoints")
    tokenizer = resolve_tokenizer_dir(None)
    meta = build_model(args, torch.float32, "meta")
    for size in ("5GB", "300KB"):
        old, new = tmp_path / f"old-{size}", tmp_path / f"new-{size}"
        save_pretrained(model, old, max_shard_size=size, source_dir=tokenizer, dtype=torch.bfloat16)
        GLM5.weights.export_checkpoint(meta, checkpoint, new, dtype=torch.bfloat16, source_dir=tokenizer, max_shard_size=size)
        assert _digests(new) == _digests(old), size
    assert len(list(new.glob("model-*.safetensors"))) > 4 and (new / INDEX_NAME).is_file()
    assert (new / "tokenizer.json").is_file()


def test_a_checkpoint_of_another_model_is_refused_before_anything_is_written(tmp_path):
    checkpoint = _save_checkpoint(build_model(get_preset("tiny"), torch.float32, seed=1), tmp_path / "checkpoints")
    wider = build_model(get_preset("tiny").replace(**ARGS), torch.float32, "meta")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="has shape .* not a checkpoint of this run's model"):
        GLM5.weights.export_checkpoint(wider, checkpoint, tmp_path / "out", dtype=torch.bfloat16, source_dir=None)
    assert changes(before, snapshot(tmp_path)) == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_runs_checkpoint_exports_as_the_run_exported_its_model(shared_results, tmp_path, capsys, nproc):
    """The run's last checkpoint (step 4) is the model its end-of-run export wrote, gathered from
    two ranks' FSDP2 shards for nproc 2 (tests/distributed/test_fsdp_train.py's run)."""
    flags = ["--nproc-per-node", "2"] if nproc == 2 else []
    run_dir = shared_run(shared_results, *WITH_EXPORT, *flags).run_dir
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), "--hf", str(out)]) == 0
    assert "(step 4)" in capsys.readouterr().out
    exported = _digests(out)
    assert "README.md" in exported  # the model card (docs/release.md): the run's own hf/ carries the same one
    assert exported == _digests(run_dir / "hf")


def _refused(capsys, argv: list[str], fragment: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("glmtune export: error: "), err
    assert fragment in err, err


def test_export_hf_keeps_the_refusals(shared_results, tmp_path, capsys):
    run_dir = shared_run(shared_results, *WITH_EXPORT).run_dir
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(run_dir), "--hf", str(out)], "already exists and is not empty")
    _refused(capsys, ["export", str(run_dir), "--hf", str(run_dir / "hf"), "--overwrite"],
             f"is inside RUN_DIR {run_dir}, which this command reads")
    _refused(capsys, ["export", str(run_dir), "--adapter", str(tmp_path / "a")],
             "only LoRA runs have an adapter (export a full fine-tuning run's model with --hf OUT)")
    _refused(capsys, ["export", str(run_dir), "--hf", str(tmp_path / "b"), "--max-shard-size", "lots"], "lots")
    assert changes(before, snapshot(tmp_path)) == []


# ~1 GB in fp32 (master weights): 3 MoE layers of 40 experts, 1024 wide; stacked gate+up 160 MiB.
BIG = dict(hidden_size=1024, moe_intermediate_size=512, n_routed_experts=40, first_k_dense_replace=1)
SLACK = 256 << 20  # allocator slack, the meta model, the plans and the checkpoint's layout
_EXPORT = ("import torch; from glmtune.models.glm5.spec import GLM5; "
           "from glmtune.models.glm5.args import get_preset; from glmtune.models.glm5.model import build_model; ")
_BASELINE = _EXPORT + PEAK


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big-export")
    model = build_model(get_preset("tiny").replace(**BIG), torch.float32, init=False)
    tile = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) - 0.5  # cheaper than 250M draws
    with torch.no_grad():
        for i, param in enumerate(model.parameters()):
            flat = param.view(-1)
            for start in range(0, flat.numel(), tile.numel()):
                part = flat[start : start + tile.numel()]
                part.copy_(tile.roll(i)[: part.numel()])
    return _save_checkpoint(model, root / "checkpoints")


def test_exporting_1gb_stays_under_the_shard_bound(big_checkpoint, tmp_path):
    stored = sum(f.stat().st_size for f in big_checkpoint.glob("*.distcp"))
    assert stored > 900e6
    out = tmp_path / "hf"
    baseline = peak_rss(_BASELINE)
    peak = peak_rss(_EXPORT + f"GLM5.weights.export_checkpoint(build_model(get_preset('tiny').replace(**{BIG!r}), torch.float32, "
                               f"'meta'), {str(big_checkpoint)!r}, {str(out)!r}, dtype=torch.bfloat16, source_dir=None, "
                               "max_shard_size='64MB'); " + PEAK)
    written = list(out.glob("*.safetensors"))
    largest_out = max(f.stat().st_size for f in written)
    largest_stored = 1024 * 1024 * 40 * 4  # one MoE layer's stacked gate+up in fp32
    bound = baseline + 2 * largest_out + (64 << 20) + largest_stored + SLACK
    print(f"peak RSS {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB, checkpoint {stored / 2**20:.0f} "
          f"MiB, bound {bound / 2**20:.0f} MiB")
    assert len(written) >= 8
    assert peak < bound, (peak, bound)
    assert peak - baseline < stored / 2  # the model in memory alone is the whole checkpoint
