"""`train.objective: distill`'s keys (config/validate.py `distill_errors`): each takes effect or is
refused in one sentence before anything is allocated, `glmtune config validate` included."""

import subprocess
import sys

import pytest

from glmtune.config.schema import JobConfig
from glmtune.config.validate import objective_errors
from tests.train.run_helpers import env


def _distill(**changes) -> JobConfig:
    cfg = JobConfig()
    cfg.train.objective = "distill"
    cfg.data.train = ["teacher/rows.jsonl"]
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def test_a_distill_run_as_given_is_accepted():
    assert objective_errors(_distill()) == []
    assert objective_errors(_distill(distill__weight=0.0)) == []
    assert objective_errors(_distill(distill__weight=0.0, parallel__pp=2)) == []  # sequence-level: any layout
    # the KL term at every layout too (tests/train/test_distill_run.py: PP 2 and CP 2 equal one process)
    assert objective_errors(_distill(parallel__pp=2)) == objective_errors(_distill(parallel__cp=2)) == []


@pytest.mark.parametrize("changes, sentence", [
    (dict(distill__weight=-0.5), "distill.weight must be >= 0, got -0.5"),
    (dict(distill__weight=float("nan")), "distill.weight must be >= 0, got nan"),
    (dict(distill__temperature=0.0), "distill.temperature must be > 0, got 0.0"),
    (dict(distill__weight=0.0, distill__temperature=2.0),
     "distill.temperature is set but distill.weight is 0 (sequence-level only: no KL to soften); remove it"),
    (dict(data__train=["a/rows.jsonl", "b/rows.jsonl"]),
     "train.objective: distill reads one teacher directory: data.train must name its rows file alone "
     "(no data.synthetic)"),
    (dict(data__too_long="truncate"),
     "data.too_long: truncate with train.objective: distill: a cut answer is not the teacher's; set "
     "data.too_long: drop"),
    (dict(data__kind="text"), "data.kind: text with train.objective: distill: the teacher's answers are chat rows; "
                              "remove data.kind"),
    (dict(dpo__beta=0.2), "dpo.beta is set but train.objective is distill; remove it"),
])
def test_each_setting_it_cannot_honour_is_one_sentence(changes, sentence):
    assert objective_errors(_distill(**changes)) == [sentence]


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_distill_keys_with_another_objective_are_refused(objective):
    cfg = JobConfig()
    cfg.train.objective = objective
    cfg.distill.weight, cfg.distill.temperature = 0.5, 2.0
    errors = [e for e in objective_errors(cfg) if e.startswith("distill.")]
    assert errors == [f"distill.weight is set but train.objective is {objective}; set train.objective: distill or "
                      "remove it",
                      f"distill.temperature is set but train.objective is {objective}; set train.objective: distill "
                      "or remove it"]


def test_config_validate_refuses_before_anything_runs():
    done = subprocess.run([sys.executable, "-m", "glmtune", "config", "validate", "tiny/distill_support_json",
                           "--distill.temperature", "-1"], env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "distill.temperature must be > 0, got -1.0" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
