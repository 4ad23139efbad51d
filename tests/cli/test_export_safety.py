"""`glmtune export` refuses what would give a wrong adapter (another run's checkpoint, a
base that changed since training, a damaged checkpoint) and never writes over what it reads
(the run, its checkpoint, its base), --overwrite or not. One sentence, nothing written.
A real LoRA run on a preset exports against the base the run wrote (RUN_DIR/base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from glmtune import save_pretrained
from glmtune.checkpoint.manager import CheckpointManager
from glmtune.cli import main
from glmtune.config import dump_config, load_config
from glmtune.models.registry import hf_dir_identity
from glmtune.models.glm5 import build_model, get_preset
from glmtune.peft import apply_lora
from glmtune.train.model_source import build_model_from_config
from glmtune.io.run_lock import write_run_record
from tests.peft.conftest import randomize_adapters
from tests.train.run_helpers import TWO_STEPS, shared_run
from tests.tree_snapshot import changes, snapshot


def _lora_run(run_dir: Path, run_id: str, base_dir: Path | None = None, step: int = 7) -> Path:
    """A LoRA run directory as `glmtune train` leaves it: config, run record, one checkpoint."""
    overrides = [f"--logging.run_dir={run_dir}"] + ([f"--model.name_or_path={base_dir}"] if base_dir else [])
    cfg = load_config("recipes/tiny/lora_support_json.yaml", overrides)
    dump_config(cfg, run_dir / "config.yaml")
    record = {"run_id": run_id}
    if base_dir is not None:
        record["base"] = hf_dir_identity(base_dir)
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


@pytest.mark.parametrize("target", ["base", "base/sub", "run", "."])
def test_the_runs_inputs_are_never_replaced_even_with_overwrite(tmp_path, capsys, target):
    base = tmp_path / "base"
    save_pretrained(build_model(get_preset("tiny"), seed=0), base)
    (base / "sub").mkdir()
    _lora_run(tmp_path / "run", "run-1", base_dir=base)
    out = (tmp_path / target).resolve()
    relation = {"base": f"is the run's base {base}", "base/sub": f"is inside the run's base {base}",
                "run": f"is RUN_DIR {tmp_path / 'run'}", ".": f"contains RUN_DIR {tmp_path / 'run'}"}[target]
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(tmp_path / "run"), "--adapter", str(out), "--overwrite"],
             f"--adapter {out} {relation}, which this command reads; choose another directory (--overwrite never "
             "replaces an input)")
    assert changes(before, snapshot(tmp_path)) == []


@pytest.fixture(scope="module")
def lora_run(shared_results) -> Path:
    """A real LoRA run of the bundled tiny recipe (a preset base: the run wrote RUN_DIR/base)."""
    return shared_run(shared_results, *TWO_STEPS, recipe="tiny/lora_support_json").run_dir


def test_a_lora_run_on_a_preset_exports_against_the_base_it_wrote(lora_run, tmp_path, capsys):
    record = json.loads((lora_run / "run.json").read_text())
    assert record["base"]["path"] == str((lora_run / "base").resolve())
    out = tmp_path / "adapter"
    assert main(["export", str(lora_run), "--adapter", str(out)]) == 0
    assert "(step 2)" in capsys.readouterr().out
    # The same adapter the run exported at its end (its last checkpoint is its last step).
    for name in ("adapter_config.json", "glmtune_adapter.json"):
        assert json.loads((out / name).read_text()) == json.loads((lora_run / "adapter" / name).read_text()), name
    saved, trained = (load_file(d / "adapter_model.safetensors") for d in (out, lora_run / "adapter"))
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)


def test_a_lora_run_whose_base_changed_or_went_is_refused(lora_run, tmp_path, capsys):
    run = shutil.copytree(lora_run, tmp_path / "run")
    config = json.loads((run / "base" / "config.json").read_text())
    config["routed_scaling_factor"] = config["routed_scaling_factor"] * 2  # another model, same shapes
    (run / "base" / "config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(run), "--adapter", str(tmp_path / "out")],
             f"the base {run / 'base'} changed since the run trained on it")
    assert changes(before, snapshot(tmp_path)) == []
    shutil.rmtree(run / "base")
    before = snapshot(tmp_path)
    _refused(capsys, ["export", str(run), "--adapter", str(tmp_path / "out")],
             f"the run's base {run / 'base'} has no config.json any more")
    assert changes(before, snapshot(tmp_path)) == []
