"""`glmtune export` refuses what would give a wrong adapter: another run's checkpoint, a
base that changed since training, a damaged checkpoint. One sentence, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from glmtune.checkpoint.hf_io import save_pretrained
from glmtune.checkpoint.manager import CheckpointManager
from glmtune.cli import main
from glmtune.config import dump_config, load_config
from glmtune.io.fingerprint import base_identity_from_dir
from glmtune.models.glm5 import build_model, get_preset
from glmtune.peft import apply_lora
from glmtune.train.recipe import build_model_from_config
from glmtune.train.run_dir import write_run_record
from tests.peft.conftest import randomize_adapters
from tests.tree_snapshot import changes, snapshot


def _lora_run(run_dir: Path, run_id: str, base_dir: Path | None = None, step: int = 7) -> Path:
    """A LoRA run directory as `glmtune train` leaves it: config, run record, one checkpoint."""
    overrides = [f"--logging.run_dir={run_dir}"] + ([f"--model.name_or_path={base_dir}"] if base_dir else [])
    cfg = load_config("recipes/tiny/lora_support_json.yaml", overrides)
    dump_config(cfg, run_dir / "config.yaml")
    record = {"run_id": run_id}
    if base_dir is not None:
        record["base"] = base_identity_from_dir(base_dir)
    write_run_record(run_dir, record)
    model, _ = build_model_from_config(cfg, "cpu")
    apply_lora(model, cfg.peft)
    randomize_adapters(model, seed=5)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return CheckpointManager(cfg.checkpoint.dir, trainable_only=True, run_id=run_id).save(step, model, optimizer, {})


def _refused(capsys, argv: list[str], fragment: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("glmtune export: error: "), err
    assert fragment in err, err


def test_another_runs_checkpoint_is_refused(tmp_path, capsys):
    _lora_run(tmp_path / "a", "run-a")
    foreign = _lora_run(tmp_path / "b", "run-b")
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(tmp_path / "a"), "--adapter", str(tmp_path / "out"), "--checkpoint", str(foreign)],
             f"--checkpoint {foreign} was written by another run (run id run-b) than {tmp_path / 'a'}")
    assert changes(before, snapshot(tmp_path)) == []


def test_a_changed_base_is_refused_and_the_adapter_records_its_base(tmp_path, capsys):
    base = tmp_path / "base"
    save_pretrained(build_model(get_preset("tiny"), seed=0), base)
    _lora_run(tmp_path / "run", "run-1", base_dir=base)
    assert main(["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "ok")]) == 0
    recorded = json.loads((tmp_path / "ok" / "glmtune_adapter.json").read_text())["base"]
    assert recorded == json.loads((tmp_path / "run" / "run.json").read_text())["base"]

    config = json.loads((base / "config.json").read_text())
    config["routed_scaling_factor"] = config["routed_scaling_factor"] * 2  # another model, same shapes
    (base / "config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "out")],
             f"the base {base} changed since the run trained on it")
    assert changes(before, snapshot(tmp_path)) == []


def test_a_damaged_checkpoint_is_refused(tmp_path, capsys):
    checkpoint = _lora_run(tmp_path / "run", "run-1")
    shard = next(checkpoint.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(tmp_path / "run"), "--adapter", str(tmp_path / "out")],
             f"checkpoint {checkpoint} is damaged: {shard.name} is")
    assert changes(before, snapshot(tmp_path)) == []
