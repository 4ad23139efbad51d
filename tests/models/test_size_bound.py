"""A config.json with no weights beside it is bounded in what it may describe (issue 44, re-test
U2): `glmtune config validate` and `glmtune plan` on a lone config.json of `vocab_size: 10**12`
(256 trillion parameters) or `hidden_size: 10**12` (a tensor of more bytes than any machine
addresses: a RuntimeError traceback even on the meta device) planned it; now it is one sentence
naming the file. The bound is 10^13 parameters (`size_bound.MAX_PARAMETERS`), counted exactly
in closed form, without building the model (tests/models/test_param_count.py holds the count
equal to the built model's).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest

from glmtune.cli import main
from glmtune.models.glm5 import get_preset
from glmtune.models.glm5.param_count import parameter_count
from glmtune.models.glm5.size_bound import MAX_PARAMETERS


def test_the_count_does_not_build_every_layer():
    began = time.perf_counter()
    count = parameter_count(get_preset("tiny").replace(num_hidden_layers=10_000))
    assert time.perf_counter() - began < 5  # building 10,000 layers on meta takes ~20 s and 1 GB
    assert count > 10_000 * 250_000  # ~286,000 per layer of the tiny preset


def _config_only(tmp_path: Path, **fields) -> Path:
    directory = tmp_path / "config-only"
    directory.mkdir()
    config = {**get_preset("tiny").to_hf_dict(), **fields}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(argv))
    return code, out.getvalue()


HOSTILE = {
    "vocab 10^12": ({"vocab_size": 10**12}, f"describes a model of 256,000,001,192,864 parameters, more than the "
                                             f"{MAX_PARAMETERS:,}"),
    "hidden 10^12": ({"hidden_size": 10**12}, "its sizes describe a tensor no machine holds"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("command", ["config validate", "plan"])
def test_a_lone_config_past_the_bound_is_refused_naming_it(tmp_path, case, command):
    fields, said = HOSTILE[case]
    directory = _config_only(tmp_path, **fields)
    code, out = _run(*command.split(), "tiny/sft_support_json", "--model.name_or_path", str(directory))
    assert code in (1, 2) and "Traceback" not in out, out
    assert f"{directory / 'config.json'}: {said}" in out, out


def test_a_lone_config_within_the_bound_validates(tmp_path):
    directory = _config_only(tmp_path, vocab_size=20_000_000)  # 5 * 10^9 parameters: a config may say so
    code, out = _run("config", "validate", "tiny/sft_support_json", "--model.name_or_path", str(directory))
    assert code == 0, out
