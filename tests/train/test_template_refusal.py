"""A chat template glmtune cannot tell the turns of is refused by `glmtune train` before the model
is built and before the run directory is written, in one line naming the template file (it was
refused only when the data was tokenized, after the model had been built and loaded)."""

from __future__ import annotations

import pytest

from glmtune.cli import main
from glmtune.config import load_config
from glmtune.train import run
from tests.data.chat_format_fixtures import build_tokenizer


def test_an_unknown_template_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    build_tokenizer(tmp_path / "gemma", "gemma", vocab_size=300)
    built = []
    monkeypatch.setattr(run, "build_model_from_config", lambda *a, **k: built.append(a) or pytest.fail("built"))
    run_dir = tmp_path / "run"
    overrides = ["--data.tokenizer", str(tmp_path / "gemma"), "--logging.run_dir", str(run_dir),
                 "--data.cache_dir", str(tmp_path / "cache"), "--train.max_steps", "2"]
    with pytest.raises(ValueError) as refused:
        run.run_training(load_config("tiny/sft_support_json", overrides))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'gemma' / 'chat_template.jinja'}: the chat template is not of a turn "
                              "format glmtune knows") and "\n" not in message
    assert built == [] and not run_dir.exists() and not (tmp_path / "cache").exists()
    # the command says it in one line and exits 2
    assert main(["train", "tiny/sft_support_json", *overrides]) == 2
    err = capsys.readouterr().err
    assert "chat_template.jinja: the chat template is not of a turn format" in err and "Traceback" not in err
    assert built == [] and not run_dir.exists()
