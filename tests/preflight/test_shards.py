"""Check 2 on a tiny sharded HF checkpoint: a missing shard, a corrupt header, and a flipped data byte
(caught only where the download recorded the shard's sha256)."""

from __future__ import annotations

from glmtune.checkpoint.integrity import file_digest
from glmtune.preflight.shards import check_shards

SHARD = "model-00002-of-00008.safetensors"


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_intact_checkpoint_passes(ckpt, fresh):
    result = check_shards(fresh("tiny/sft_support_json", "--model.name_or_path", str(ckpt)))
    assert result.status == "pass", result.message
    assert result.evidence["verify"]["num_files"] == 8 and "bytes are not verified" in result.message


def test_missing_shard_fails(ckpt, fresh):
    (ckpt / SHARD).unlink()
    result = check_shards(fresh("tiny/sft_support_json", "--model.name_or_path", str(ckpt)))
    assert result.status == "fail"
    assert result.message.startswith(f"{SHARD}: missing (named in model.safetensors.index.json")


def test_corrupt_header_fails(ckpt, fresh):
    _flip(ckpt / SHARD, 8)  # the first byte of the JSON header
    result = check_shards(fresh("tiny/sft_support_json", "--model.name_or_path", str(ckpt)))
    assert result.status == "fail" and f"{SHARD}: corrupt safetensors header" in result.message


def test_flipped_data_byte_fails_against_the_recorded_hash(ckpt, fresh):
    # what `huggingface-cli download --local-dir` records: commit, then the LFS etag (the file's sha256)
    metadata = ckpt / ".cache" / "huggingface" / "download" / f"{SHARD}.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text(f"{'a' * 40}\n{file_digest(ckpt / SHARD)['sha256']}\n1700000000.0\n")
    pf = fresh("tiny/sft_support_json", "--model.name_or_path", str(ckpt))
    assert check_shards(pf).evidence["sha256"][SHARD]["actual"] == file_digest(ckpt / SHARD)["sha256"]
    _flip(ckpt / SHARD, (ckpt / SHARD).stat().st_size - 1)  # the last byte of the last tensor
    result = check_shards(pf)
    assert result.status == "fail"
    assert result.message.startswith(f"{SHARD}: sha256 ") and "the file is corrupt" in result.message
    assert result.evidence["verify"]["ok"]  # headers alone cannot see it
