"""The tool executor: schema validation, a hung or crashing function never hangs or kills eval."""

from __future__ import annotations

import time

import pytest

from glmtune.eval.tools import ToolExecutor, tool_response

TOOLS_PY = '''
import os, time
def ok(x):
    print("noise on stdout")  # must not corrupt the answer channel
    return {"x": x}
def text(x): return "plain " + x
def hang(x): time.sleep(60)
def boom(x): raise KeyError(x)
def die(x): os._exit(3)
def odd(x): return object()
def huge(x): return "y" * (2 << 20)
'''
NAMES = ("ok", "text", "hang", "boom", "die", "odd", "huge")
SPECS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}} for n in (*NAMES, "unregistered")]


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tools")
    (directory / "suite_tools.py").write_text(TOOLS_PY)  # imported from the suite's directory
    with ToolExecutor({n: f"suite_tools:{n}" for n in NAMES}, 0.5, directory) as ex:
        ex.check()
        yield ex


def test_results_errors_timeouts_and_crashes(executor):
    assert tool_response(executor.run("ok", {"x": "a"}, SPECS)) == '{"x": "a"}'
    assert executor.run("text", {"x": "a"}, SPECS).result == "plain a"
    began = time.monotonic()
    hung = executor.run("hang", {"x": "a"}, SPECS)
    assert not hung.ok and hung.error == "timed out after 0.5 s (killed)" and time.monotonic() - began < 5
    assert executor.run("ok", {"x": "b"}, SPECS).result == '{"x": "b"}'  # a fresh worker after the kill
    boom = executor.run("boom", {"x": "ORD-1"}, SPECS)
    assert not boom.ok and boom.error == "raised KeyError: 'ORD-1'"
    assert tool_response(boom) == '{"error": "raised KeyError: \'ORD-1\'"}'
    died = executor.run("die", {"x": "a"}, SPECS)
    assert not died.ok and "exited (code 3)" in died.error
    assert "not JSON serializable" in executor.run("odd", {"x": "a"}, SPECS).error
    assert executor.run("text", {"x": "c"}, SPECS).ok
    huge = executor.run("huge", {"x": "a"}, SPECS)
    assert not huge.ok and huge.error == "the result is longer than 1,048,576 characters (MAX_RESULT_CHARS)"
    assert executor.run("text", {"x": "d"}, SPECS).result == "plain d"  # the rest of the line went with the worker


def test_arguments_are_validated_against_the_rows_schema(executor):
    bad = executor.run("ok", {"y": "a"}, SPECS)
    assert not bad.ok and bad.error == "invalid arguments: 'x' is a required property"
    assert "offers no tool 'ok'" in executor.run("ok", {"x": "a"}, SPECS[1:]).error
    assert "no function is registered for tool 'unregistered'" in executor.run("unregistered", {"x": "a"},
                                                                             SPECS).error


def test_a_function_that_does_not_import_is_a_suite_error(tmp_path):
    with ToolExecutor({"t": "no_such_module_here:f"}, 1.0, tmp_path) as ex:
        with pytest.raises(ValueError, match=r"tools.functions.t: cannot use no_such_module_here:f: "
                                             r"ModuleNotFoundError"):
            ex.check()
