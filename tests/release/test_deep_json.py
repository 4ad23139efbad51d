"""Every JSON (and the YAML config) `glmtune release`, `verify` and `diff` read is parsed with its
nesting bounded: a file nested 100,000 deep is a one-line error naming it, not a RecursionError."""

from __future__ import annotations

import pytest

from glmtune.cli import main

DEEP = "[" * 100_000 + "]" * 100_000


def _one_line_error(capsys, argv: list[str], path) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("glmtune release: error: ") and err.count("\n") == 1, err[-2000:]
    assert str(path) in err and "nested" in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("where", ["eval:scorecard.json", "run:run.json", "run:data_manifest.json",
                                   "run:config.yaml", "run:hf/config.json", "previous"])
def test_deep_input_of_release(sft_run, tmp_path, capsys, where):
    run, eval_dir = sft_run
    argv = ["release", str(run), "--eval", str(eval_dir), "--engine", "vllm==0.11.0"]
    if where == "previous":
        path = tmp_path / "previous.json"
        argv += ["--previous", str(path)]
    else:
        directory, name = where.split(":")
        path = (eval_dir if directory == "eval" else run) / name
    path.write_text(DEEP)
    _one_line_error(capsys, argv, path)
    assert not (run / "release.json").exists()


def test_deep_release_for_verify_and_diff(tmp_path, capsys):
    deep = tmp_path / "release.json"
    deep.write_text(DEEP)
    _one_line_error(capsys, ["release", "verify", str(deep)], deep)
    _one_line_error(capsys, ["release", "diff", str(deep), str(deep)], deep)


def test_oversized_record_is_refused_before_it_is_read(tmp_path):
    from glmtune.release.artifacts import read_json

    big = tmp_path / "scorecard.json"
    big.write_text('{"format": "' + "x" * 100 + '"}')
    with pytest.raises(ValueError, match=rf"^{big}: 114 bytes, more than the 64 a JSON record may have$"):
        read_json(big, str(big), max_bytes=64)
