"""MLflow through the metrics sink (`logging.mlflow`): a tiny run's step records, read back with
MlflowClient from a local `file:` store, equal its metrics.jsonl; its params are the resolved config."""

from __future__ import annotations

import json

import pytest
import yaml

from glmtune.train.metrics import MetricsWriter, flat_params
from tests.train.run_helpers import run

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


def _only_run(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(found) == 1
    return client, found[0]


def test_a_tiny_run_logs_its_metrics_and_config_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this process's client; the run sets its own
    uri = (tmp_path / "mlruns").as_uri()
    run_dir = tmp_path / "run"
    done = run(run_dir, tmp_path / "cache", "--train.max_steps", "2", "--logging.mlflow", uri)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    client, found = _only_run(uri, config["name"])
    assert found.info.status == "FINISHED" and found.info.run_name == config["name"]
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected.setdefault(key, []).append((record["step"], float(value)))
    assert "loss" in expected and [step for step, _ in expected["loss"]] == [1, 2]
    for key, values in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        assert history == values, key
    assert found.data.params["optim.lr"] == json.dumps(config["optim"]["lr"])
    assert found.data.params["logging.mlflow"] == uri
    assert found.data.params == flat_params(config)


def test_mlflow_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # as if not installed
    with pytest.raises(ValueError, match=r"logging.mlflow is set but the mlflow package is not installed"):
        MetricsWriter(tmp_path, "metrics.jsonl", False, mlflow_uri=(tmp_path / "mlruns").as_uri())
