"""A frozen FP8 base under torchrun (gloo, CPU): each rank reads only its slices of the
e4m3 weights and of their block scales (`load_sharded`), expert parallelism shards both,
and LoRA on it trains step by step like one process, exporting the same adapters; a bf16
checkpoint onto a sharded FP8 base is refused with glmtune's one-line error (torchrun then
adds its own report of the failed ranks; one process quantizes such a checkpoint)."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors.torch import load_file

from glmtune import save_pretrained
from glmtune.models.glm5 import build_model, get_preset
from tests.checkpoint.test_fp8_base_load import ARGS, shared_fp8_checkpoint
from tests.distributed.forked_runs import train_in_forks
from tests.distributed.test_expert_parallel_train import _assert_same, _records
from tests.train.run_helpers import SMALL, env, shared_run

RECIPE = "tiny/lora_support_json"


def _steps(base):
    return ["--train.max_steps", "3", "--checkpoint.every_steps", "3", "--model.name_or_path", str(base),
            "--data.tokenizer", "glmtune/data/assets/tiny_tokenizer", "--model.fp8_base", "dequant"]


def test_lora_on_a_sharded_fp8_base_matches_one_process(tmp_path, shared_results):
    base = shared_fp8_checkpoint(shared_results)
    single = shared_run(shared_results, *_steps(base), recipe=RECIPE)  # also tests/train/test_fp8_base_train.py
    train_in_forks({tmp_path / "ep2": [*_steps(base), "--parallel.ep", "2"]}, single.cache_dir, nproc=2, recipe=RECIPE)
    out = (tmp_path / "ep2.out").read_text()  # the forked ranks' (tests/distributed/forked_runs.py), as torchrun's
    assert "model: frozen FP8 base" in out and f"loaded {base}, rank 0: read" in " ".join(out.split())
    _assert_same(_records(tmp_path / "ep2"), _records(single.run_dir))
    # lora_fp8_1node.yaml's schedule: the experts' all-to-alls in 2 chunks over the FP8 base, as one process.
    chunks = [*_steps(base), "--parallel.ep", "2", "--parallel.ep_overlap_chunks", "2"]
    train_in_forks({tmp_path / "ep2-chunks2": chunks}, single.cache_dir, nproc=2, recipe=RECIPE)
    _assert_same(_records(tmp_path / "ep2-chunks2"), _records(single.run_dir))
    ours = load_file(tmp_path / "ep2" / "adapter" / "adapter_model.safetensors")
    theirs = load_file(single.run_dir / "adapter" / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        # As in the bf16 EP test: Adam turns reduction-order noise in near-zero gradients into ~1e-6 moves.
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_checkpoint_onto_a_sharded_fp8_base_is_refused(tmp_path):
    base = save_pretrained(build_model(get_preset("tiny").replace(**ARGS), seed=1), tmp_path / "bf16")
    cmd = [sys.executable, "-m", "glmtune", "train", RECIPE, "--nproc-per-node", "2", *SMALL, "--logging.run_dir",
           str(tmp_path / "run"), "--data.cache_dir", str(tmp_path / "cache"), *_steps(base)]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "glmtune train: error: " in output and "a sharded FP8 base loads FP8 checkpoints only" in output, output
