"""`glmtune train recipes/tiny/dpo_support_json.yaml` before the SFT demo has run (issue 49): the DPO
demo continues from the SFT demo's `hf/`, so the refusal says so and gives the command that makes
it, before anything is written."""

from __future__ import annotations

from glmtune.cli import main


def test_dpo_demo_before_the_sft_demo_names_the_command_that_makes_its_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no runs/tiny-sft-support-json here
    run_dir = tmp_path / "dpo-run"
    assert main(["train", "tiny/dpo_support_json", "--logging.run_dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "runs/tiny-sft-support-json/hf does not exist yet: tiny/dpo_support_json continues from" in err
    assert "`make demo` (or `glmtune train recipes/tiny/sft_support_json.yaml`)" in err
    assert not run_dir.exists()


def test_a_missing_path_no_recipe_makes_is_refused_as_before(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "tiny/sft_support_json", "--model.name_or_path", "nowhere/hf",
                 "--logging.run_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "nowhere/hf" in err and "neither a preset" in err and "make demo" not in err, err
