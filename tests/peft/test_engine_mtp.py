"""An adapter with MTP-layer adapters (a LoRA run with `train.mtp_loss_weight > 0`) against the
engines' facts (docs/lora.md, "The MTP layer under LoRA"), through the CLI: `glmtune export
--engine sglang` refuses it, `--engine vllm` refuses it with an adapted `eh_proj` and otherwise
writes it with a warning (vLLM drafts with the base MTP layer); `glmtune release` refuses and
records the same. An adapter without them exports as before. Real 2-step runs of the tiny recipe."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from glmtune.cli import main
from glmtune.config import ModelConfig, PeftConfig
from glmtune.models.glm5.lora_rules import DEFAULT_LORA_TARGETS
from glmtune.models.registry import model_args, model_spec
from glmtune.peft import apply_lora
from glmtune.peft.engines import adapter_traits
from tests.release.conftest import copy_run
from tests.release.eval_fixture import make_eval_dir
from tests.train.run_helpers import TWO_STEPS, shared_run

MTP = "model.layers.4"  # the tiny preset's MTP layer on disk: 4 decoder layers, then MTP layer 0
MTP_LOSS = ["--train.mtp_loss_weight", "0.3"]
WITH_EH = ["--peft.target_modules", json.dumps([*DEFAULT_LORA_TARGETS, "*.eh_proj"])]
RECIPE = "tiny/lora_support_json"
WAY_OUT = ("to serve the trained drafter, merge it into the base (glmtune merge BASE_DIR RUN_DIR/adapter OUT_DIR) "
           "and serve OUT_DIR with the engine's MTP speculative decoding")


@pytest.fixture(scope="module")
def plain_run(shared_results) -> Path:  # also tests/peft/test_engines.py's and tests/release's
    return shared_run(shared_results, *TWO_STEPS, recipe=RECIPE).run_dir


@pytest.fixture(scope="module")
def mtp_run(shared_results) -> Path:
    return shared_run(shared_results, *TWO_STEPS, *MTP_LOSS, recipe=RECIPE).run_dir


@pytest.fixture(scope="module")
def mtp_eh_run(shared_results) -> Path:
    return shared_run(shared_results, *TWO_STEPS, *MTP_LOSS, *WITH_EH, recipe=RECIPE).run_dir


@pytest.fixture(scope="module")
def mtp_loss_only_run(shared_results) -> Path:
    """The MTP loss on, the MTP layer kept out of the adapter: the refusals' way out."""
    return shared_run(shared_results, *TWO_STEPS, *MTP_LOSS, "--peft.exclude_modules", '["mtp.*"]',
                      recipe=RECIPE).run_dir


def _glmtune(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _refused_before_writing(run: Path, engine: str, tmp_path: Path) -> str:
    """The export's one-line error (exit 2, no traceback); neither a new nor an existing empty OUT
    receives anything."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    code, out, err = _glmtune("export", str(run), "--adapter", str(tmp_path / "new"), "--engine", engine)
    assert (code, out) == (2, ""), err
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    assert _glmtune("export", str(run), "--adapter", str(tmp_path / "empty"), "--engine", engine)[:3] == (2, out, err)
    assert list((tmp_path / "empty").iterdir()) == []
    assert err.startswith(f"glmtune export: error: --engine {engine}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def test_the_traits_name_the_mtp_layer_as_the_state_dict_adapter_does(plain_run, mtp_run, mtp_eh_run):
    # GLM-5 (on meta): the MTP layer after the 78 decoder layers, from num_hidden_layers, not a constant
    glm5 = ModelConfig(name_or_path="glm5")
    model = model_spec(glm5).weights.build(model_args(glm5), torch.float32, "meta")
    model_spec(glm5).compute.set_auxiliary_training(model, mtp=True, indexer=False)
    apply_lora(model, PeftConfig(method="lora", target_modules=[*DEFAULT_LORA_TARGETS, "*.eh_proj"]))
    traits = adapter_traits(model, 16, 32.0, False)
    assert (traits.mtp_layers, traits.mtp_eh_proj) == (("model.layers.78",), ("model.layers.78.eh_proj",))
    # The runs: what their inventories (trainable.json, row mtp) and their exported adapters hold.
    from glmtune.cli.export_cmd import adapter_model
    from glmtune.config import load_run_config

    for run, layers, eh_proj in ((plain_run, (), ()), (mtp_run, (MTP,), ()), (mtp_eh_run, (MTP,), (f"{MTP}.eh_proj",))):
        cfg = load_run_config(run / "config.yaml")
        traits = adapter_traits(adapter_model(cfg), cfg.peft.rank, cfg.peft.alpha, cfg.peft.rslora)
        assert (traits.mtp_layers, traits.mtp_eh_proj) == (layers, eh_proj), run
        assert bool(json.loads((run / "trainable.json").read_text())["groups"]["mtp"]["targets"]) == bool(layers)
        config = json.loads((run / "adapter_per_expert" / "adapter_config.json").read_text())
        with safe_open(run / "adapter_per_expert" / "adapter_model.safetensors", "pt") as tensors:
            assert any(f".{MTP}." in k for k in tensors.keys()) == bool(layers)
        assert ("eh_proj" in config["target_modules"]) == bool(eh_proj)


def test_export_for_sglang_refuses_an_adapter_with_mtp_layer_adapters(mtp_run, mtp_eh_run, tmp_path):
    for run in (mtp_run, mtp_eh_run):
        err = _refused_before_writing(run, "sglang", tmp_path / run.parent.name)
        assert f"the adapter holds LoRA tensors of the MTP layer ({MTP}.*, trained with train.mtp_loss_weight > 0)" \
            in err
        assert "sglang 0.5.23 fails to load an adapter with MTP-layer tensors (the server does not start)" in err
        assert WAY_OUT in err
        assert "train without the MTP loss (train.mtp_loss_weight 0) or without MTP targets " \
               '(peft.exclude_modules ["mtp.*"])' in err


def test_export_for_vllm_refuses_an_adapted_mtp_eh_proj(mtp_eh_run, tmp_path):
    err = _refused_before_writing(mtp_eh_run, "vllm", tmp_path)
    assert f"the adapter adapts the MTP layer's eh_proj ({MTP}.eh_proj, peft.target_modules \"*.eh_proj\")" in err
    assert "vllm 0.34.0 refuses such an adapter (eh_proj is no module of the model it adapts)" in err
    assert WAY_OUT in err and "train without the MTP loss (train.mtp_loss_weight 0)" in err
    assert 'or without "*.eh_proj" (then vllm loads it but drafts with the base MTP layer)' in err


def test_export_for_vllm_writes_mtp_layer_adapters_with_a_warning(mtp_run, tmp_path):
    out = tmp_path / "vllm"
    code, printed, err = _glmtune("export", str(mtp_run), "--adapter", str(out), "--engine", "vllm")
    assert code == 0, err
    assert f"vllm serve {(mtp_run / 'base').resolve()} --enable-lora --lora-modules adapter={out.resolve()}" in printed
    assert "warning" not in printed
    [warning] = err.splitlines()
    assert warning.startswith(f"warning: the adapter's MTP-layer tensors ({MTP}.*, trained with "
                              "train.mtp_loss_weight > 0) load but are never applied: vllm 0.34.0 applies the "
                              "decoder layers' adapters only, and its MTP draft model (speculative decoding) runs "
                              "the base MTP layer, not the trained drafter"), warning
    assert warning.endswith(WAY_OUT)
    # Written as the run's own engine layout: the MTP layer's tensors included.
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (mtp_run / "adapter_per_expert" / name).read_bytes(), name


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_adapter_without_mtp_layer_adapters_exports_as_before(plain_run, tmp_path, engine):
    code, printed, err = _glmtune("export", str(plain_run), "--adapter", str(tmp_path / "e"), "--engine", engine)
    assert (code, err) == (0, "")
    adapter, base = (tmp_path / "e").resolve(), (plain_run / "base").resolve()
    command = {"vllm": f"vllm serve {base} --enable-lora --lora-modules adapter={adapter} --max-lora-rank 8 "
                       "--max-loras 1",
               "sglang": f"python -m sglang.launch_server --model-path {base} --enable-lora --lora-paths "
                         f"adapter={adapter} --max-lora-rank 8 --lora-target-modules down_proj gate_proj "
                         "kv_a_proj_with_mqa o_proj q_a_proj q_b_proj up_proj --disable-shared-experts-fusion"}[engine]
    checked = {"vllm": "0.34.0", "sglang": "0.5.23"}[engine]
    assert printed.splitlines() == [
        f"exported per_expert adapter from {plain_run / 'checkpoints' / 'step-00000002'} (step 2) to {tmp_path / 'e'}",
        f"wrote the model card {tmp_path / 'e' / 'README.md'}",
        f"serve it with {engine} (facts checked against {engine} {checked}, docs/lora.md):", f"  {command}"]
    # The same files as the per-expert export without an engine (which reads no engine fact).
    assert _glmtune("export", str(plain_run), "--adapter", str(tmp_path / "p"), "--layout", "per_expert")[0] == 0
    for name in ("adapter_config.json", "adapter_model.safetensors", "glmtune_adapter.json"):
        assert (tmp_path / "e" / name).read_bytes() == (tmp_path / "p" / name).read_bytes(), name


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_way_out_without_mtp_targets_exports_for_both_engines(mtp_loss_only_run, tmp_path, engine):
    code, printed, err = _glmtune("export", str(mtp_loss_only_run), "--adapter", str(tmp_path / "e"),
                                  "--engine", engine)
    assert (code, err) == (0, "") and "serve it with" in printed
    with safe_open(tmp_path / "e" / "adapter_model.safetensors", "pt") as tensors:
        assert not any(f".{MTP}." in k for k in tensors.keys())


def _release(run: Path, tmp_path: Path, engine: str) -> tuple[Path, int, str, str]:
    copy = copy_run(run, tmp_path / "run")
    eval_dir = make_eval_dir(tmp_path / "eval", copy)
    return (copy, *_glmtune("release", str(copy), "--eval", str(eval_dir), "--engine", engine))


@pytest.mark.parametrize("engine, variant, why", [
    ("sglang==0.5.23", "mtp", f"the adapter holds LoRA tensors of the MTP layer ({MTP}.*"),
    ("sglang==0.5.23", "mtp_eh", f"the adapter holds LoRA tensors of the MTP layer ({MTP}.*"),
    ("vllm==0.34.0", "mtp_eh", f"the adapter adapts the MTP layer's eh_proj ({MTP}.eh_proj"),
], ids=["sglang-mtp", "sglang-mtp_eh_proj", "vllm-mtp_eh_proj"])
def test_release_refuses_what_the_export_refuses(request, tmp_path, engine, variant, why):
    run, code, printed, err = _release(request.getfixturevalue(f"{variant}_run"), tmp_path, engine)
    assert (code, printed) == (2, ""), err
    assert err.startswith(f"glmtune release: error: --engine {engine}: {why}") and WAY_OUT in err, err
    assert not (run / "release.json").exists()


def test_release_for_vllm_records_that_the_mtp_adapters_are_not_applied(mtp_run, tmp_path):
    run, code, printed, err = _release(mtp_run, tmp_path, "vllm==0.34.0")
    assert code == 0, err
    engine = json.loads((run / "release.json").read_text())["engine"]
    [caveat] = engine["caveats"]
    assert caveat.startswith(f"the adapter's MTP-layer tensors ({MTP}.*, trained with train.mtp_loss_weight > 0) load "
                             "but are never applied: vllm 0.34.0 applies the decoder layers' adapters only")
    assert caveat.endswith(WAY_OUT)
    assert engine["serve_command"].startswith(f"vllm serve {(run / 'base').resolve()} --enable-lora")
    assert f"  caveat    {caveat}" in printed.splitlines()


@pytest.mark.parametrize("engine", ["vllm==0.34.0", "sglang==0.5.23"])
def test_release_of_an_adapter_without_mtp_layer_adapters_records_no_caveat(plain_run, tmp_path, engine):
    run, code, printed, err = _release(plain_run, tmp_path, engine)
    assert code == 0, err
    assert json.loads((run / "release.json").read_text())["engine"]["caveats"] == []
    assert "caveat" not in printed
