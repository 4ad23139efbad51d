"""Untrusted text: terminal escapes shown, names that are paths refused, JSON bounded."""

import pytest

from glmtune.io.text_limits import json_depth, parse_json, printable, safe_name


def test_printable_escapes_terminal_controls():
    forged = "release ok\x1b[2K\r\x1b[32mok\x1b[0m\x07\u202e"
    shown = printable(forged)
    assert "\x1b" not in shown and "\r" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert shown == "release ok\\x1b[2K\\x0d\\x1b[32mok\\x1b[0m\\x07\\u202e"


def test_printable_keeps_lines_only_when_asked():
    assert printable("a\nb\tc") == "a\\x0ab\\x09c"
    assert printable("a\nb\tc\x1b", multiline=True) == "a\nb\tc\\x1b"
    assert printable(3.5) == "3.5" and printable("héllo ✓") == "héllo ✓"


@pytest.mark.parametrize("name", ["", ".", "..", " ", "../../x", "a/b", "a\\b", "/abs", "-rf", "~user",
                                  "nul\x00", "esc\x1b[1m", "x" * 129])
def test_safe_name_refuses_paths(name):
    with pytest.raises(ValueError, match="suite.name"):
        safe_name(name, "suite.name")


def test_safe_name_refuses_non_strings():
    with pytest.raises(ValueError, match="must be a name"):
        safe_name(["a"], "sets[0].name")


@pytest.mark.parametrize("name", ["support-json", "v1.2_final", "..hidden-but-fine", "élan"])
def test_safe_name_accepts_names(name):
    assert safe_name(name, "x") == name


def test_parse_json_bounds_depth_without_recursion_error():
    with pytest.raises(ValueError, match="arguments: JSON nested deeper than 64"):
        parse_json("[" * 100_000 + "]" * 100_000, "arguments")
    with pytest.raises(ValueError, match="nested deeper than 3"):
        parse_json('{"a": {"b": {"c": {"d": 1}}}}', "x", max_depth=3)
    assert parse_json('{"a": {"b": {"c": 1}}}', "x", max_depth=3) == {"a": {"b": {"c": 1}}}


def test_parse_json_bounds_size_and_names_bad_json():
    with pytest.raises(ValueError, match="x: 11 bytes of JSON, more than the 10 allowed"):
        parse_json('"' + "a" * 9 + '"', "x", max_bytes=10)
    with pytest.raises(ValueError, match="x: not valid JSON"):
        parse_json("{", "x")


def test_json_depth():
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [[1]]}) == 3
