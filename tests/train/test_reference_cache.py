"""The DPO reference log-probability cache (glmtune/train/reference_logps.py): its key sees a weight
file swapped in with the same name, size and modification time (the content sample), so a second
run on another base computes its own reference (first loss ln 2) instead of reusing the first
base's; a cache file that is not what `save` writes is refused in one sentence naming it."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune import save_pretrained
from glmtune.checkpoint.safetensors_header import read_header
from glmtune.data.tokenizer import resolve_tokenizer_dir
from glmtune.models.glm5 import build_model, get_preset
from glmtune.train import reference_logps
from tests.checkpoint_fixtures import Q_A, weight_map
from tests.train.run_helpers import losses, run_in_fork


def _swap_keeping_size_and_times(file: Path, replacement: Path) -> None:
    """`file` gets `replacement`'s bytes; its size must match, and its times are put back (os.utime)."""
    before = file.stat()
    assert replacement.stat().st_size == before.st_size
    shutil.copyfile(replacement, file)
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_swapped_weight_file_changes_the_key(ckpt, tmp_path):
    identity = reference_logps.model_files_identity(ckpt)
    name = weight_map(ckpt)[Q_A]
    tensors = load_file(ckpt / name)
    tensors[Q_A] = tensors[Q_A] * 1.01  # another fine-tune of the same architecture: same header, same size
    save_file(tensors, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    _swap_keeping_size_and_times(ckpt / name, tmp_path / "other.safetensors")
    swapped = reference_logps.model_files_identity(ckpt)
    assert [f[:3] for f in swapped["files"]] == [f[:3] for f in identity["files"]]  # names, sizes, mtimes
    assert swapped["content"] != identity["content"]
    rows = [{"input_ids": [1, 2], "labels": [1, 2], "position_ids": [0, 1], "document_ids": [0, 0]}]
    assert reference_logps.cache_key(swapped, {}, rows, []) != reference_logps.cache_key(identity, {}, rows, [])
    _swap_keeping_size_and_times(ckpt / name, tmp_path / "other.safetensors")  # the same bytes again
    assert reference_logps.model_files_identity(ckpt)["content"] == swapped["content"]
    assert reference_logps.model_files_identity(ckpt) == reference_logps.model_files_identity(ckpt)


def _wait_for_the_file_clock_to_pass(ctime_ns: int, probe: Path) -> None:
    while True:
        probe.touch()
        if probe.stat().st_ctime_ns > ctime_ns:
            probe.unlink()
            return


def test_a_rewrite_the_content_sample_misses_changes_the_key(ckpt):
    """Bytes rewritten in place between the sampled ones (a tensor's last quarter), the modification
    time put back: the sample is the same, the status-change time is not."""
    name = weight_map(ckpt)[Q_A]
    entries, data_start = read_header(ckpt / name)
    begin, end = (data_start + offset for offset in entries[Q_A]["data_offsets"])
    at = end - (end - begin) // 4
    identity = reference_logps.model_files_identity(ckpt)
    before = (ckpt / name).stat()
    _wait_for_the_file_clock_to_pass(before.st_ctime_ns, ckpt / "probe")  # a coarse one ticks every few ms
    with open(ckpt / name, "r+b") as f:
        f.seek(at)
        tail = f.read(end - reference_logps.SAMPLE_BYTES - at)
        f.seek(at)
        f.write(bytes(255 - b for b in tail))
    os.utime(ckpt / name, ns=(before.st_atime_ns, before.st_mtime_ns))
    rewritten = reference_logps.model_files_identity(ckpt)
    assert rewritten["content"] == identity["content"]  # the sample did not see it
    rows = [{"input_ids": [1, 2], "labels": [1, 2], "position_ids": [0, 1], "document_ids": [0, 0]}]
    assert reference_logps.cache_key(rewritten, {}, rows, []) != reference_logps.cache_key(identity, {}, rows, [])


def _values(rows: int = 3) -> list[torch.Tensor]:
    return [torch.randn(4) for _ in range(rows)]


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


def _saved(path: Path) -> dict[str, torch.Tensor]:
    reference_logps.save(path, _values(), [], {"rows": 3})
    return load_file(path)


CACHE_EDITS = {
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size - 9]),
    "cut into the header": lambda p: p.write_bytes(p.read_bytes()[:20]),
    "not safetensors": lambda p: p.write_text("reference: 0.5\n" * 8),
    "a tensor missing": lambda p: _write(p, {k: v for k, v in _saved(p).items() if k != "train.counts"}),
    "values of another dtype": lambda p: _write(p, {**_saved(p), "train.values": _saved(p)["train.values"].double()}),
    "counts that do not add up": lambda p: _write(p, {**_saved(p), "train.counts": torch.tensor([4, 4, 5])}),
    "negative counts": lambda p: _write(p, {**_saved(p), "train.counts": torch.tensor([8, 8, -4])}),
    "values of two dimensions": lambda p: _write(p, {**_saved(p), "train.values": torch.zeros(3, 4)}),
}


@pytest.mark.parametrize("case", list(CACHE_EDITS))
def test_a_cache_file_that_is_not_what_save_writes_is_one_sentence(tmp_path, case):
    path = tmp_path / "reference_logps" / "key.safetensors"
    reference_logps.save(path, _values(), [], {"rows": 3})
    CACHE_EDITS[case](path)
    rows = [{"labels": [0, 1, 2, 3, 4]} for _ in range(3)]  # 4 supervised targets each, as saved
    with pytest.raises(ValueError) as caught:
        reference_logps.load(path, rows, [])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: not a reference log-probability cache"), message
    assert message.endswith("delete it to compute them again"), message


# test_preference_run.py's full fine-tuning flags (the recipe's LoRA rank and alpha put back to their
# defaults, which a full fine-tune must leave), few rows, one step, no checkpoint.
FULL = ["--peft.method", "none", "--peft.rank", "32", "--peft.alpha", "64", "--data.packed_sequence_size", "512",
        "--data.synthetic.rows", "40", "--train.max_steps", "1", "--optim.warmup_steps", "0",
        "--checkpoint.every_steps", "0"]


def test_a_second_run_on_a_swapped_base_computes_its_own_reference(tmp_path):
    """The issue's case: a DPO full fine-tune, then the base's weights swapped for another's of the same
    size with the modification time put back. The second run must not reuse the first base's reference:
    its policy is its reference at step 1, so the first loss is ln 2."""
    base, other = tmp_path / "base", tmp_path / "other"
    save_pretrained(build_model(get_preset("tiny"), seed=0), base)
    save_pretrained(build_model(get_preset("tiny"), seed=1), other)
    flags = [*FULL, "--model.name_or_path", str(base), "--data.tokenizer", str(resolve_tokenizer_dir(None))]
    cache = tmp_path / "cache"
    first = run_in_fork(tmp_path / "first", cache, *flags, recipe="tiny/dpo_support_json")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    assert losses(tmp_path / "first")[1] == pytest.approx(math.log(2), abs=1e-6)
    _swap_keeping_size_and_times(base / "model.safetensors", other / "model.safetensors")
    second = run_in_fork(tmp_path / "second", cache, *flags, recipe="tiny/dpo_support_json")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert losses(tmp_path / "second")[1] == pytest.approx(math.log(2), abs=1e-6)  # 0.7137 when reused (rows of 1024)
    assert "computed from the starting weights" in second.stdout.replace("\n", "")
    assert len(list((cache / "reference_logps").glob("*.safetensors"))) == 2
