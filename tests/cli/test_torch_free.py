"""`glmtune --help`, every subcommand's `--help` and `glmtune config validate` import no torch (issue 45).

They answer in a fraction of a second only while nothing they import pulls in torch (seconds to
import on a loaded machine), transformers, safetensors or numpy. Each command runs in a fresh
interpreter through `glmtune.cli.main`, which then lists the heavy modules it finds in
`sys.modules`: one import anywhere below a command (a registry, a family's model code, a
checkpoint reader) shows here, named.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from glmtune.cli import build_parser
from glmtune.config import RECIPES_DIR
from glmtune.models.glm5 import get_preset

HEAVY = ("torch", "transformers", "safetensors", "numpy")

# Runs `glmtune ARGV...` in this interpreter, then prints the heavy modules loaded, last, on stderr.
_PROBE = f"""
import json, sys
from glmtune.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help
    code = exc.code
print("heavy: " + json.dumps(sorted(set(sys.modules) & set({HEAVY!r}))), file=sys.stderr)
sys.exit(code)
"""


def _glmtune(*argv: str) -> tuple[int, str, list[str]]:
    """(exit status, stdout, heavy modules imported) of `glmtune ARGV` in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120,
                          cwd=RECIPES_DIR.parent)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert last.startswith("heavy: "), done.stderr
    return done.returncode, done.stdout, json.loads(last.removeprefix("heavy: "))


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser: (), ("inspect",), ("data", "validate"), ..."""
    found = [words]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*words, name))
    return found


@pytest.mark.parametrize("words", _commands(build_parser()), ids=lambda words: " ".join(words) or "glmtune")
def test_help_imports_no_torch(words):
    code, out, heavy = _glmtune(*words, "--help")
    assert code == 0 and "usage: glmtune" in out, out
    assert heavy == [], f"glmtune {' '.join(words)} --help imported {heavy}"


def _recipes(eval_suites: bool) -> list[str]:
    # eval_*.yaml are eval suites (`glmtune eval --suite`), not training recipes: validate refuses them
    found = sorted(str(p) for p in RECIPES_DIR.glob("*/*.yaml") if p.name.startswith("eval_") == eval_suites)
    assert found, RECIPES_DIR
    return found


def test_config_validate_of_every_recipe_imports_no_torch():
    recipes = _recipes(eval_suites=False)
    code, out, heavy = _glmtune("config", "validate", *recipes)
    assert code == 0, out
    assert [line.split()[1] for line in out.splitlines() if not line.startswith(" ")] == recipes, out
    assert "pp stages 36 stages of 1-3 layers" in out  # the pipeline split, from the family's stage costs
    assert heavy == [], f"config validate imported {heavy}"


def test_config_validate_refusing_eval_suites_imports_no_torch():
    code, out, heavy = _glmtune("config", "validate", *_recipes(eval_suites=True))
    assert code == 1 and out.startswith("FAIL ") and "unknown key" in out, out
    assert heavy == [], f"config validate imported {heavy}"


def test_config_validate_of_an_hf_directory_imports_no_torch(saved, tmp_path):
    """A checkpoint directory (the tiny preset saved with its weights) and a lone config.json:
    validated from config.json alone, the weights never opened."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_dict()))
    for directory in (Path(saved), config_only):
        code, out, heavy = _glmtune("config", "validate", "tiny/sft_support_json", "--model.name_or_path",
                                    str(directory))
        assert code == 0 and f"8 experts (8 per EP rank), 4 layers, pp 1 (one stage of 4 layers) [{directory}/config.json]" in out, out
        assert heavy == [], f"config validate of {directory} imported {heavy}"


def test_export_offers_the_exporters_adapter_layouts():
    """`glmtune export --layout` names the layouts itself, so that its --help needs no torch."""
    from glmtune.cli.export_cmd import ADAPTER_LAYOUTS
    from glmtune.peft.adapter_export import LAYOUTS

    assert ADAPTER_LAYOUTS == LAYOUTS
