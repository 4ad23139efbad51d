"""Untrusted text: terminal escapes (and lone surrogates) shown, names that are paths refused, JSON
bounded: its depth, what a parse builds, lone surrogates, and on request non-finite numbers and
duplicate keys."""

import json
import tracemalloc

import pytest

from glmtune.io.text_limits import clipped, json_depth, parse_json, printable, safe_name


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


def _peak(run) -> int:
    """The bytes `run()` allocated at its peak (tracemalloc)."""
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_json_depth_allocates_nothing_per_element():
    flat, deep = [0] * 200_000, [[[{"a": [1, 2.5, "x"]}]]] * 1000
    # The old walk stacked 200,000 (value, depth) tuples: ~16 MB. tracemalloc counts every thread's allocations
    # (a test process's idle helper threads included: 4,165 bytes once in CI), so the bound is 64 KiB, not 4.
    assert _peak(lambda: json_depth(flat)) < 65536
    assert json_depth(flat) == 1 and json_depth(deep) == 5 and json_depth([[], {}]) == 2


def test_a_container_budget_refuses_a_bomb_before_building_it():
    bomb = b'{"choices": [{"text": "x"}], "junk": [' + b"{}," * 200_000 + b"{}]}"  # 600 kB, 200,005 containers
    with pytest.raises(ValueError, match=r"^answer: 200,005 JSON arrays and objects in 600,042 bytes, more than the "
                                         r"65,536 allowed \(one per 16 bytes\)$"):
        parse_json(bomb, "answer", bytes_per_container=16)
    refused = _peak(lambda: pytest.raises(ValueError, parse_json, bomb, "answer", bytes_per_container=16))
    assert refused < 2 * len(bomb), refused  # the text, decoded; parsed it takes ~25 x its bytes
    assert len(parse_json(bomb, "answer")["junk"]) == 200_001  # no budget asked: parsed as before


def test_the_budget_counts_brackets_outside_strings_only():
    text = json.dumps({"text": "{[" * 100_000, "quote": 'a \\"[{" b', "n": [[1], {"a": [2]}]})  # 200,000 in a string
    assert parse_json(text, "x", bytes_per_container=16)["n"] == [[1], {"a": [2]}]
    many = "[" + ",".join(['"{\\"[{"'] * 70_000 + ["[]"] * 70_000) + "]"  # 70,001 containers: over 65,536
    with pytest.raises(ValueError, match="70,001 JSON arrays and objects"):
        parse_json(many, "x", bytes_per_container=16)


@pytest.mark.parametrize("text", ['"a\\ud800b"', '{"k\\udc80": 1}', '["\\ud83d"]', '"\\uDBFF\\u0041"'])
def test_a_lone_surrogate_is_refused(text):
    with pytest.raises(ValueError, match=r"^x: not valid Unicode: lone surrogate \\ud[89abcdef][0-9a-f]{2} escaped"):
        parse_json(text, "x")
    with pytest.raises(ValueError, match="not valid Unicode: lone surrogate"):
        parse_json(text.encode(), "x")


def test_a_surrogate_pair_and_a_literal_backslash_u_are_text():
    assert parse_json('"\\ud83d\\ude00 \\\\ud800"', "x") == "\U0001F600 \\ud800"
    with pytest.raises(ValueError, match="not valid JSON"):  # UTF-8 of a surrogate: json's surrogatepass let it in
        parse_json(b'["\xed\xa0\x80"]', "x")
    assert parse_json('["é"]'.encode("utf-16"), "x") == ["é"]  # UTF-16 with a BOM, as json detects it


@pytest.mark.parametrize("text", ["NaN", "[1, Infinity]", '{"a": -Infinity}', "1e999", "[-1e400]"])
def test_non_finite_numbers_are_refused_on_request(text):
    with pytest.raises(ValueError, match=r"^x: a number that is not finite \((nan|inf|-inf): NaN, Infinity"):
        parse_json(text, "x", allow_nan=False)
    parse_json(text, "x")  # json's own reading (metrics.jsonl may hold a NaN loss glmtune wrote)


def test_duplicate_keys_are_refused_on_request():
    with pytest.raises(ValueError, match=r"^x: key 'b' given twice$"):
        parse_json('{"a": {"b": 1, "b": 2}}', "x", unique_keys=True)
    assert parse_json('{"a": 1, "a": 2}', "x") == {"a": 2}


def test_printable_shows_lone_surrogates():
    assert printable("a\ud800b") == "a\\ud800b" and printable("\udcff", multiline=True) == "\\udcff"
    assert clipped("id \ud801 x").encode("utf-8") == b"id \\ud801 x"
