"""`glmtune merge` (and the unmerged application `glmtune eval --merged` uses) on a hostile adapter
or base: a weights file cut short, not safetensors or with a malformed header; an adapter config,
a glmtune_adapter.json or a base config.json that is nested, of the wrong type or too large;
LoRA factors that are not two matrices of one rank; a base index whose names leave the base.
Each is one line naming the file, exit status 2, nothing written."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmtune.models.registry import hf_dir_identity
from glmtune.checkpoint.hf_io import INDEX_NAME
from glmtune.cli import main
from glmtune.models.glm5 import build_model, get_preset
from glmtune.peft import apply_lora, export_adapter
from glmtune.peft.adapter_export import CONFIG_NAME, META_NAME, WEIGHTS_NAME
from glmtune.peft.adapter_load import apply_adapter
from tests.checkpoint_fixtures import weight_map
from tests.peft.conftest import lora_cfg, randomize_adapters


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory) -> Path:
    """An adapter of the tiny model `saved` holds, recording that base (glmtune_adapter.json)."""
    model = build_model(get_preset("tiny"), seed=0)
    apply_lora(model, lora_cfg())
    randomize_adapters(model, seed=3)
    return export_adapter(model, tmp_path_factory.mktemp("adapter") / "adapter",
                          base_identity=hf_dir_identity(saved))


@pytest.fixture
def adapter(exported, tmp_path) -> Path:
    return Path(shutil.copytree(exported, tmp_path / "adapter"))


def _json(name: str, value) -> callable:
    text = value if isinstance(value, str) else json.dumps(value)
    return lambda a: (a / name).write_text(text)


def _edit_config(**changes) -> callable:
    def apply(a: Path) -> None:
        config = json.loads((a / CONFIG_NAME).read_text())
        (a / CONFIG_NAME).write_text(json.dumps({**config, **changes}))
    return apply


def _edit_factors(edit) -> callable:
    def apply(a: Path) -> None:
        tensors = load_file(a / WEIGHTS_NAME)
        key = sorted(k for k in tensors if k.endswith("lora_A.weight"))[0]
        tensors[key] = edit(tensors[key])
        save_file(tensors, str(a / WEIGHTS_NAME))
    return apply


def _cut(name: str, keep) -> callable:
    return lambda a: (a / name).write_bytes((a / name).read_bytes()[: keep((a / name).stat().st_size)])


def _bad_entry(a: Path) -> None:
    header = json.dumps({"base_model.model.x.lora_A.weight": {"dtype": "F32", "shape": "4", "data_offsets": [0, 4]}})
    (a / WEIGHTS_NAME).write_bytes(struct.pack("<Q", len(header)) + header.encode() + b"\0" * 4)


ADAPTER_EDITS = {
    "weights truncated": (_cut(WEIGHTS_NAME, lambda n: n // 2), f"{WEIGHTS_NAME}: truncated safetensors file"),
    "weights cut into the header": (_cut(WEIGHTS_NAME, lambda n: 20), f"{WEIGHTS_NAME}: not a safetensors file"),
    "weights not safetensors": (lambda a: (a / WEIGHTS_NAME).write_text("not tensors at all\n" * 4),
                                f"{WEIGHTS_NAME}: not a safetensors file"),
    "weights header entry": (_bad_entry, "corrupt safetensors header: tensor"),
    "a factor of one dimension": (_edit_factors(lambda t: t.flatten()), "not a matrix of floating-point numbers"),
    "an integer factor": (_edit_factors(lambda t: t.to(torch.int32)), "not a matrix of floating-point numbers"),
    "ranks differ": (_edit_factors(lambda t: torch.cat([t, t[:1]])), "(one rank for both)"),
    "config nested": (_json(CONFIG_NAME, "[" * 100_000 + "]" * 100_000), f"{CONFIG_NAME}: JSON nested deeper"),
    "config a list": (_json(CONFIG_NAME, []), f"{CONFIG_NAME}: not an adapter config"),
    "config huge": (_json(CONFIG_NAME, {"peft_type": "LORA", "pad": "x" * (2 << 20)}),
                    f"{CONFIG_NAME}: 2,097,"),
    "rank a string": (_edit_config(r="4"), f"{CONFIG_NAME}: r is '4', not a positive integer"),
    "rank negative": (_edit_config(r=-4), f"{CONFIG_NAME}: r is -4, not a positive integer"),
    "alpha a list": (_edit_config(lora_alpha=[8]), f"{CONFIG_NAME}: lora_alpha is [8], not a number"),
    "targets a number": (_edit_config(target_parameters=5), "target_parameters is not a list of names"),
    "rslora a string": (_edit_config(use_rslora="yes"), "use_rslora is not true or false"),
    "record nested": (_json(META_NAME, "[" * 100_000 + "]" * 100_000), f"{META_NAME}: JSON nested deeper"),
    "record a list": (_json(META_NAME, [1]), f"{META_NAME}: not a glmtune adapter record"),
    "record base a list": (_json(META_NAME, {"base": [1]}), f"{META_NAME}: not a glmtune adapter record"),
    "record hash a number": (_json(META_NAME, {"base": {"weights_sha256": 5}}), "not a glmtune adapter record"),
}


def _merge_refused(capsys, base: Path, adapter: Path, out: Path, fragment: str) -> None:
    capsys.readouterr()
    assert main(["merge", str(base), str(adapter), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("glmtune merge: error: "), err
    assert fragment in err, err
    assert not out.exists()


@pytest.mark.parametrize("case", list(ADAPTER_EDITS))
def test_merge_refuses_a_hostile_adapter_in_one_line(ckpt, adapter, tmp_path, capsys, case):
    edit, fragment = ADAPTER_EDITS[case]
    edit(adapter)
    _merge_refused(capsys, ckpt, adapter, tmp_path / "out", fragment)


@pytest.mark.parametrize("case", [c for c in ADAPTER_EDITS if not c.startswith("record")])
def test_the_unmerged_adapter_refuses_the_same_files(adapter, case):
    """`glmtune eval --merged` applies the adapter unmerged (adapter_load.py): the same refusals."""
    edit, fragment = ADAPTER_EDITS[case]
    edit(adapter)
    with pytest.raises(ValueError) as caught:
        apply_adapter(build_model(get_preset("tiny"), seed=0), adapter)
    assert "\n" not in str(caught.value) and fragment in str(caught.value), str(caught.value)


def test_the_adapter_as_written_merges(ckpt, adapter, tmp_path, capsys):
    assert main(["merge", str(ckpt), str(adapter), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


def _index_names(ckpt: Path, name_of) -> None:
    index = json.loads((ckpt / INDEX_NAME).read_text())
    first = sorted(set(weight_map(ckpt).values()))[0]
    index["weight_map"] = {k: (name_of(ckpt, v) if v == first else v) for k, v in index["weight_map"].items()}
    (ckpt / INDEX_NAME).write_text(json.dumps(index))


def _copy_out(ckpt: Path, name: str) -> str:
    outside = ckpt.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(ckpt / name, outside / name)
    return str(outside / name)


BASE_EDITS = {
    "an index name through ..": (lambda c: _index_names(c, lambda ck, v: "../outside/" + Path(_copy_out(ck, v)).name),
                                 "which leaves the checkpoint directory through '..'"),
    "an absolute index name": (lambda c: _index_names(c, lambda ck, v: "/etc/passwd"), "which is an absolute path"),
    "config.json a list": (lambda c: (c / "config.json").write_text("[]"), "config.json: not a config"),
}


@pytest.mark.parametrize("case", list(BASE_EDITS))
def test_merge_refuses_a_hostile_base_in_one_line(ckpt, adapter, tmp_path, capsys, case):
    edit, fragment = BASE_EDITS[case]
    edit(ckpt)
    (adapter / META_NAME).unlink()  # no recorded base: the base is read by the merge itself, not the check
    capsys.readouterr()
    assert main(["merge", str(ckpt), str(adapter), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("note: ADAPTER_DIR") and len(err) == 2, err
    assert err[1].startswith("glmtune merge: error: ") and fragment in err[1], err
    assert not (tmp_path / "out").exists()
