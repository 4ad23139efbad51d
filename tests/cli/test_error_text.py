"""A user error quotes what the user wrote; a terminal escape in it is shown, never executed."""

from __future__ import annotations

from glmtune.cli import describe_error, main


def test_an_escape_in_a_value_is_shown_escaped(capsys, tmp_path):
    recipe = tmp_path / "r\x1b[32mok\x1b[0m.yaml"
    assert main(["config", "show", str(recipe)]) == 2  # a user error, through describe_error
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b[32mok" in err, err
    assert main(["config", "validate", str(recipe)]) == 1  # validate's own report
    out = capsys.readouterr().out
    assert "\x1b" not in out and "FAIL " in out and "\\x1b[32mok" in out, out


def test_describe_error_keeps_lines_and_escapes_controls():
    assert describe_error(ValueError("a\nb\x07")) == "a\nb\\x07"
    assert describe_error(FileNotFoundError(2, "No such file or directory", "x\x1b]0;t\x07")) == \
        "No such file or directory: x\\x1b]0;t\\x07"
