"""The trained runs `make test-engines` checks the engines against: one per variants.VARIANTS
key, trained with the project's venv (GLMTUNE_PYTHON), or the runs GLMTUNE_ENGINE_RUNS points at."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from capture import ROOT, glmtune_python  # noqa: E402
from variants import RECIPE, VARIANTS  # noqa: E402


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    if os.environ.get("GLMTUNE_ENGINE_RUNS"):
        return Path(os.environ["GLMTUNE_ENGINE_RUNS"])
    root = tmp_path_factory.mktemp("runs")
    for variant, overrides in VARIANTS.items():
        subprocess.run([glmtune_python(), "-m", "glmtune", "train", RECIPE,
                        "--train.max_steps", "2", "--optim.warmup_steps", "0", "--train.generate_samples", "0",
                        "--logging.run_dir", str(root / variant), *overrides],
                       cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return root
