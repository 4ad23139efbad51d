"""Opt-in (`make test-engines`): the adapter item of the serve command (`glmtune.peft.engines.lora_item`)
parsed by the installed engines' own code: vLLM's LoRAParserAction (and LoRAModulePath), SGLang's
LoRAPathAction and the loop of arg_groups/lora_hook.py that splits NAME=PATH. Their sources are read
and those pieces executed as written (importing the modules whole needs the serving stack: fastapi,
uvloop, a GPU build). tests/peft/test_engines.py checks the same names and paths against a
transcription of these parsers."""

import argparse
import ast
import importlib.util
import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm.lora.lora_model", reason="vLLM is not installed here: run `make test-engines`")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: run `make test-engines`", allow_module_level=True)

from glmtune.peft.engines import ENGINES, lora_item  # noqa: E402

CASES = [("adapter", "/tmp/x/step=2,final"), ("adapter", "/runs/a,b/adapter_per_expert"), ("my=name", "/m/a"),
         ("adapter", "/m/with space/a "), ("adapter", "/m/{a}"), ("adapter", "/m/new\nline"), ("ad,apter", "/m/a"),
         ("adapter", "/m/plain")]


def _package(name: str) -> Path:
    return Path(importlib.util.find_spec(name).submodule_search_locations[0])


def _node(path: Path, test):
    text = path.read_text()
    return text, next(n for n in ast.walk(ast.parse(text)) if test(n))


def _class(path: Path, name: str) -> str:
    text, node = _node(path, lambda n: isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(text, node)


def _vllm_parser() -> argparse.ArgumentParser:
    root = _package("vllm")
    scope = {"argparse": argparse, "json": json, "Sequence": Sequence, "dataclass": dataclass}
    exec("@dataclass\n" + _class(root / "entrypoints/openai/models/protocol.py", "LoRAModulePath"), scope)
    exec(_class(root / "entrypoints/common/cli_args.py", "LoRAParserAction"), scope)
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-modules", nargs="+", action=scope["LoRAParserAction"])
    return parser


class _LoRARef(types.SimpleNamespace):
    @staticmethod
    def deterministic_id(name, path):
        return f"{name}|{path}"


def _sglang_reads(item: str) -> tuple[str, str]:
    root = _package("sglang") / "srt" / "arg_groups"
    scope = {"argparse": argparse, "json": json}
    exec(_class(root / "argparse_actions.py", "LoRAPathAction"), scope)
    parser = argparse.ArgumentParser()
    parser.add_argument("--lora-paths", nargs="*", action=scope["LoRAPathAction"])
    paths = parser.parse_args(["--lora-paths", item]).lora_paths
    # the loop of lora_hook.py that turns each item into a LoRARef
    text, loop = _node(root / "lora_hook.py", lambda n: isinstance(n, ast.For) and ast.unparse(n.iter) == "cfg.lora_paths")
    refs: list = []
    exec(ast.get_source_segment(text, loop), {"cfg": types.SimpleNamespace(lora_paths=paths), "LoRARef": _LoRARef,
                                              "parsed_lora_paths": refs})
    [ref] = refs
    return ref.lora_name, ref.lora_path


@pytest.mark.parametrize("name, path", CASES)
def test_vllm_reads_the_item_back(name, path):
    [module] = _vllm_parser().parse_args(["--lora-modules", lora_item(ENGINES["vllm"], name, path, "/m/base")]
                                         ).lora_modules
    assert (module.name, module.path) == (name, path)


@pytest.mark.parametrize("name, path", CASES)
def test_sglang_reads_the_item_back(name, path):
    assert _sglang_reads(lora_item(ENGINES["sglang"], name, path, "/m/base")) == (name, path)
