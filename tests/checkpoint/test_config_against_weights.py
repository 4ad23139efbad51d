"""An HF directory whose config.json describes another model than its weights is refused before
anything is allocated at the config's sizes (issue 44, re-test U2).

`vocab_size: 20000000` beside a tiny checkpoint had `glmtune eval --base DIR` allocate 10 GB
(10^12: 512 TB, "internal error: DefaultCPUAllocator"), and `glmtune train` claim its run
directory first. Every load now compares the shapes the config implies (the meta-device model
through the state-dict adapter, the same check as `glmtune inspect --verify`) with the
safetensors headers, and refuses a mismatch, a missing or an unexpected tensor in one sentence
naming the file and the tensor. The loads run in a subprocess under a 3 GiB address-space limit:
the code before the fix tried to allocate the config's sizes, and the limit keeps that from the
machine (it then fails with an allocation error, not the sentence).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from glmtune.models.glm5.spec import GLM5
from tests.checkpoint.test_sharded_load import _parallel_model
from tests.checkpoint_fixtures import weight_map
from tests.distributed.gloo_helpers import run_gloo
from tests.train.run_helpers import SMALL, env

ADDRESS_SPACE = 3 << 30  # torch imported and the tiny model loaded take ~1.2 GiB of it
EMBED = "model.embed_tokens.weight"


def _set(**fields):
    return lambda config: {**config, **fields}


def _layers(count: int):
    def edit(config):
        config = {k: v for k, v in config.items() if k not in ("mlp_layer_types", "indexer_types")}
        return {**config, "num_hidden_layers": count}
    return edit


CASES = {  # config.json edit -> what the sentence says (after the file)
    "vocab 20 million": (_set(vocab_size=20_000_000), rf"{EMBED}: shape \(4096, 128\), expected \(20000000, 128\)"),
    "vocab 10^12": (_set(vocab_size=10**12), rf"{EMBED}: shape \(4096, 128\), expected \(1000000000000, 128\)"),
    "heads 10^6": (_set(num_attention_heads=10**6, num_key_value_heads=10**6),
                   r"model\.layers\.0\.self_attn\.q_b_proj\.weight: shape \(192, 64\), expected \(48000000, 64\)"),
    # Enumerated per expert, 10^9 experts would never end: the comparison stops past what is stored.
    "experts 10^9": (_set(n_routed_experts=10**9, n_group=1, topk_group=1),
                     r"model\.layers\.2\.mlp\.gate\.weight: shape \(8, 128\), expected \(1000000000, 128\)"),
    # More layers than stored tensors: said before a 5,000-layer model is built on meta.
    "layers 5000": (_layers(5000), r"holds \d+ tensors, fewer than config\.json's 5,000 layers"),
    # A tensor of more than 2^63 bytes cannot be described even on the meta device.
    "hidden 10^12": (_set(hidden_size=10**12), r"config\.json: does not load: its sizes describe a tensor no "
                                               r"machine holds"),
}


def _hostile_dir(saved: Path, root: Path, edit) -> Path:
    """The saved checkpoint's shards hard-linked (nothing copied; a symbolic link would lead out of
    the directory), config.json edited."""
    directory = root
    directory.mkdir(parents=True)
    for file in saved.iterdir():
        if file.name != "config.json":
            os.link(file, directory / file.name)
    config = edit(json.loads((saved / "config.json").read_text()))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


_LOAD_EACH = """
import json, sys, torch
from glmtune import load_pretrained
said = {}
for path in sys.argv[1:]:
    try:
        load_pretrained(path, dtype=torch.float32)
        said[path] = "loaded"
    except ValueError as exc:
        said[path] = "ValueError: " + str(exc)
    except BaseException as exc:  # the old code: an allocation error under the limit
        said[path] = type(exc).__name__ + ": " + str(exc)[:300]
print(json.dumps(said))
"""


def test_load_pretrained_refuses_a_config_its_weights_do_not_match(saved, tmp_path):
    dirs = {case: _hostile_dir(saved, tmp_path / case.replace(" ", "_"), edit) for case, (edit, _) in CASES.items()}
    done = subprocess.run([sys.executable, "-c", _LOAD_EACH, *map(str, dirs.values())], env=env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    for case, directory in dirs.items():
        message = said[str(directory)]
        assert message.startswith(f"ValueError: {directory}/"), (case, message)
        assert "\n" not in message, (case, message)
        assert re.search(CASES[case][1], message), (case, message)
        assert f"glmtune inspect {directory} --verify" in message, (case, message)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmtune", *argv], env=env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=_limited, cwd=cwd)


def test_train_refuses_it_before_the_run_directory_is_claimed(saved, tmp_path):
    directory = _hostile_dir(saved, tmp_path / "vocab", CASES["vocab 20 million"][0])
    run_dir = tmp_path / "run"
    done = _cli("train", "tiny/sft_support_json", *SMALL, "--model.name_or_path", str(directory),
                "--logging.run_dir", str(run_dir), "--data.cache_dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert f"{directory}/model.safetensors.index.json" not in done.stderr  # the shard, not the index
    assert f"{EMBED}: shape (4096, 128), expected (20000000, 128)" in done.stderr, done.stderr
    assert not run_dir.exists()  # no config.yaml, run.json or lock: nothing was written


def test_inspect_refuses_it_and_verify_lists_it(saved, tmp_path):
    directory = _hostile_dir(saved, tmp_path / "heads", CASES["heads 10^6"][0])
    done = _cli("inspect", str(directory), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert "q_b_proj.weight: shape (192, 64), expected (48000000, 64)" in done.stderr
    verified = _cli("inspect", str(directory), "--verify", cwd=tmp_path)
    assert verified.returncode == 1, verified.stderr[-3000:]
    shard = weight_map(directory)["model.layers.0.self_attn.q_b_proj.weight"]
    assert f"{shard}: model.layers.0.self_attn.q_b_proj.weight: shape (192, 64), expected (48000000, 64)" \
        in verified.stdout


def _sharded_load_refuses(rank: int, world_size: int, path: str, out: str) -> None:
    model = _parallel_model(Path(path), world_size, ep=2)
    with pytest.raises(ValueError) as caught:
        GLM5.weights.load_sharded(model, path, None)
    Path(out, f"rank{rank}.txt").write_text(str(caught.value))


def test_load_sharded_refuses_it_on_every_rank_before_allocating(saved, tmp_path):
    directory = _hostile_dir(saved, tmp_path / "vocab", CASES["vocab 10^12"][0])
    run_gloo(_sharded_load_refuses, 2, tmp_path, str(directory), str(tmp_path))
    for rank in range(2):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert f"{EMBED}: shape (4096, 128), expected (1000000000000, 128)" in message, message
