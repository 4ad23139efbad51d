"""`glmtune export RUN --hf OUT` of an hf-family full fine-tuning run (it said "the hf family does not do
exporting a DCP training checkpoint to HF yet"): a tiny Qwen3 with tied embeddings and a tiny
Qwen3-MoE, each trained 2 steps by `glmtune train` with a checkpoint at step 2 and the run's own HF
export (transformers' `save_pretrained` of the trained model), then exported from the checkpoint,
streamed (checkpoint/export_stream.py). The two directories hold the same tensors byte for byte
under the base's names (per-expert MoE tensors, no tied head), the same config.json and
generation_config.json (the base's, which the run's from_pretrained kept, not transformers' default),
and load in transformers to the same logits; no transformers progress bar is printed."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config, Qwen3MoeConfig

from glmtune.cli import main
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR
from glmtune.models.hf.quiet import no_progress_bars
from tests.train.run_helpers import TWO_STEPS, run_in_fork

SHAPES = {"vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 512,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "qwen3_tied": lambda: Qwen3Config(**SHAPES, tie_word_embeddings=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}
PROGRESS_BARS = ("Writing model shards", "Loading weights")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def trained_run(request, tmp_path_factory):
    """(base directory, run directory) of 2 full fine-tuning steps, checkpointed and exported by the run."""
    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    with no_progress_bars():
        base = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
        base.save_pretrained(root / "base")
        # a generation config of the base's own (transformers derives another from config.json)
        GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0, do_sample=True, temperature=0.7,
                         top_p=0.8).save_pretrained(root / "base")
    done = run_in_fork(root / "run", root / "cache", "--model.name_or_path", str(root / "base"), "--data.tokenizer",
                       str(TINY_TOKENIZER_DIR), *TWO_STEPS, "--checkpoint.export_hf", "true")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "base", root / "run"


def _export(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["export", *argv])
    return code, out.getvalue()


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return {key: tensor for file in sorted(directory.glob("*.safetensors")) for key, tensor in load_file(file).items()}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_export_of_the_checkpoint_equals_the_runs_own_export(trained_run, tmp_path):
    base, run_dir = trained_run
    out = tmp_path / "exported"
    code, printed = _export([str(run_dir), "--hf", str(out), "--max-shard-size", "100KB"])
    assert code == 0, printed
    assert "step 2" in printed and not any(bar in printed for bar in PROGRESS_BARS), printed
    ours, theirs = _tensors(out), _tensors(run_dir / "hf")
    assert ours.keys() == theirs.keys() == load_file(base / "model.safetensors").keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key].view(torch.uint8), tensor.view(torch.uint8)), key
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    for name in ("config.json", "generation_config.json"):
        assert _json(out / name) == _json(run_dir / "hf" / name), name
    assert _json(out / "generation_config.json")["temperature"] == 0.7  # the base's own
    assert (out / "tokenizer.json").read_bytes() == (TINY_TOKENIZER_DIR / "tokenizer.json").read_bytes()

    with no_progress_bars():
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
        reference = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32, local_files_only=True)
    ids = torch.randint(3, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)
    before = load_file(base / "model.safetensors")
    assert not all(torch.equal(before[k].to(theirs[k].dtype), theirs[k]) for k in theirs)  # 2 steps moved it

