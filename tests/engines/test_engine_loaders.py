"""Opt-in (`make test-engines`): re-derive tests/peft/engine_fixtures/ with the installed vLLM and
SGLang and compare. Trains the variants with the project's venv (GLMTUNE_PYTHON) unless
GLMTUNE_ENGINE_RUNS points at runs already made (one folder per capture.VARIANTS key)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.lora.lora_model", reason="vLLM is not installed here: run `make test-engines`")
if importlib.util.find_spec("sglang") is None:  # only its sources are read (importing it needs CUDA-era deps)
    pytest.skip("SGLang is not installed here: run `make test-engines`", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import capture  # noqa: E402

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    if os.environ.get("GLMTUNE_ENGINE_RUNS"):
        return Path(os.environ["GLMTUNE_ENGINE_RUNS"])
    root = tmp_path_factory.mktemp("runs")
    python = os.environ.get("GLMTUNE_PYTHON", str(ROOT / ".venv/bin/python"))
    for variant, overrides in capture.VARIANTS.items():
        subprocess.run([python, "-m", "glmtune", "train", "recipes/tiny/lora_support_json.yaml",
                        "--train.max_steps", "2", "--optim.warmup_steps", "0", "--train.generate_samples", "0",
                        "--logging.run_dir", str(root / variant), *overrides],
                       cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return root


def test_engines_match_fixtures(runs_root):
    for name, derived in capture.capture(runs_root).items():
        saved = json.loads((capture.FIXTURES / name).read_text())
        assert json.loads(json.dumps(derived, sort_keys=True)) == saved, name
