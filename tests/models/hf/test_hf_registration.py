"""The hf family in the catalog and the registry: which family a model goes to (a native
model_type to its family, any other causal LM to hf, `model.family` forcing one), the refusals of
that choice naming `model.family`, and `glmtune config validate` of a Qwen3 directory without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from glmtune.config import RECIPES_DIR, load_config
from glmtune.models import catalog, registry
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.spec import GLM5
from glmtune.models.hf.spec import HF

RECIPE = "recipes/tiny/sft_support_json.yaml"


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory):
    """A GLM-5 directory (the tiny preset's config.json; `model_type: glm_moe_dsa`)."""
    directory = tmp_path_factory.mktemp("glm5_config")
    (directory / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    return directory


def _model(name_or_path, *options: str):
    return load_config(None, [f"--model.name_or_path={name_or_path}", *options]).model


def test_a_native_model_type_goes_to_its_family_any_other_causal_lm_to_hf(qwen3_dir, glm5_dir):
    assert catalog.family_for(qwen3_dir).name == "hf" and registry.spec_for(qwen3_dir) is HF
    assert catalog.family_for(glm5_dir).name == "glm5" and registry.spec_for(glm5_dir) is GLM5
    assert catalog.family_for("tiny").name == "glm5"  # a preset is its family's, never hf
    assert registry.model_spec(_model(qwen3_dir)) is HF
    dims = registry.model_dims(_model(qwen3_dir))  # through the spec: weights checked against config.json
    assert (dims.num_experts, dims.num_layers) == (0, 2)
    assert registry.model_args(_model(qwen3_dir)).model_type == "qwen3"


def test_model_family_forces_hf_on_a_native_model_type(glm5_dir, qwen3_dir):
    forced = _model(glm5_dir, "--model.family=hf")
    assert catalog.model_family(forced).name == "hf" and registry.model_spec(forced) is HF
    assert catalog.model_args(forced).architecture == "GlmMoeDsaForCausalLM"  # read as transformers' config
    assert catalog.model_family(_model(qwen3_dir, "--model.family=hf")).name == "hf"
    assert catalog.model_family(_model(glm5_dir, "--model.family=glm5")).name == "glm5"
    assert catalog.model_family(_model(glm5_dir, "--model.family=auto")).name == "glm5"


@pytest.mark.parametrize(("where", "family", "message"), [
    ("qwen3", "glm5", r"^model.family: glm5 trains model_type 'glm_moe_dsa', but .*/config.json has model_type "
                      r"'qwen3'; set model.family: auto$"),
    ("tiny", "hf", r"^model.family: hf does not take the preset 'tiny' \(a preset of glm5\); set "
                   r"model.name_or_path to an HF directory$"),
    ("qwen3", "llama", r"^model.family: 'llama' is not a model family; choose auto, glm5, hf$"),
    ("tiny", "llama", r"^model.family: 'llama' is not a model family"),
])
def test_what_model_family_cannot_force_is_refused_naming_it(qwen3_dir, where, family, message):
    model = _model(qwen3_dir if where == "qwen3" else where, f"--model.family={family}")
    for resolve in (catalog.model_dims, catalog.model_args, registry.model_spec):
        with pytest.raises(ValueError, match=message):
            resolve(model)


def test_config_validate_of_a_qwen3_directory_imports_no_torch(qwen3_dir):
    probe = ("import json, sys; from glmtune.cli import main; code = main(sys.argv[1:]); "
             "print('heavy: ' + json.dumps(sorted({'torch', 'transformers', 'safetensors', 'numpy'} & set(sys.modules))),"
             " file=sys.stderr); sys.exit(code)")
    for options, ok in (([], True), (["--model.family", "glm5"], False)):
        done = subprocess.run([sys.executable, "-c", probe, "config", "validate", RECIPE, "--model.name_or_path",
                               str(qwen3_dir), *options], capture_output=True, text=True, timeout=120,
                              cwd=RECIPES_DIR.parent)
        assert done.stderr.strip().splitlines()[-1] == "heavy: []", done.stderr
        assert (done.returncode == 0) == ok, done.stdout
        expected = f"0 experts (0 per EP rank), 2 layers, pp 1 (one stage of 2 layers) [{qwen3_dir}/config.json]" if ok else \
            "model.family: glm5 trains model_type 'glm_moe_dsa'"
        assert expected in done.stdout, done.stdout
