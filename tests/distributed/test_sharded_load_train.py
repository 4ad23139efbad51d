"""`glmtune train` from an HF checkpoint under torchrun never holds the whole model on one
rank: it builds on the meta device, parallelizes, and each rank reads only its shards
(`load_sharded`). The run equals the one-process run step by step, "before" samples
included (generated on the sharded model), and exports the same checkpoint."""

from __future__ import annotations

import torch

from glmtune.checkpoint.hf_io import load_pretrained, save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from tests.distributed.test_expert_parallel_train import _assert_same, _records, _torchrun
from tests.train.run_helpers import run

TOKENIZER = "glmtune/data/assets/tiny_tokenizer"


def test_ep2_from_an_hf_checkpoint_reads_only_its_shards_and_trains_like_one_process(tmp_path):
    base = tmp_path / "base"
    save_pretrained(build_model(get_preset("tiny"), seed=0), base, max_shard_size="1MB")
    cache = tmp_path / "cache"
    extra = ["--train.max_steps", "3", "--checkpoint.every_steps", "3", "--model.name_or_path", str(base),
             "--data.tokenizer", TOKENIZER, "--train.generate_samples", "2", "--checkpoint.export_hf", "true"]
    single = run(tmp_path / "single", cache, *extra)
    assert single.returncode == 0, single.stdout + single.stderr
    done = _torchrun(2, tmp_path / "ep2", cache, *extra, "--parallel.ep", "2")
    out = " ".join(done.stdout.split())
    assert f"loaded {base}, rank 0: read" in out  # about half the bytes: its experts, its FSDP shard
    _assert_same(_records(tmp_path / "ep2"), _records(tmp_path / "single"))
    exported = load_pretrained(tmp_path / "ep2" / "hf", dtype=torch.float32).state_dict()
    reference = load_pretrained(tmp_path / "single" / "hf", dtype=torch.float32).state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-4, atol=1e-5, msg=name)  # Adam: see EP test
