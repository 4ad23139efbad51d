"""The process that runs a suite's tool functions (started by `tools.ToolExecutor`).

Run as a script (`python tool_worker.py SEARCH_DIR`), so it imports only the standard library
and the tool modules themselves. It reads one JSON request per line on stdin and answers one
JSON line on the stdout it was started with:

    {"function": "pkg.mod:fn", "arguments": {...}}  ->  {"ok": true, "result": "<text>"}
                                                        {"ok": false, "exception": "KeyError: 'x'"}
    {"function": "pkg.mod:fn", "check": true}       ->  {"ok": true} once it imports and is callable

A result that is a string is sent as is, anything else as JSON text (what a tool turn shows);
an exception becomes "Type: message". The tool's own prints go to stderr (file descriptor 1 is
moved away first), so they cannot corrupt the answers. Only JSON crosses the pipe: nothing a
tool returns is unpickled by the evaluator.
"""

import importlib
import json
import os
import sys


def _resolve(ref, cache):
    if ref not in cache:
        module_name, _, function_name = ref.partition(":")
        function = getattr(importlib.import_module(module_name), function_name)
        if not callable(function):
            raise TypeError(f"{ref} is a {type(function).__name__}, not a function")
        cache[ref] = function
    return cache[ref]


def _answer(request, cache):
    try:
        function = _resolve(request["function"], cache)
        if request.get("check"):
            return {"ok": True}
        result = function(**request["arguments"])
        if not isinstance(result, str):
            result = json.dumps(result, ensure_ascii=False)
        return {"ok": True, "result": result}
    except Exception as exc:  # every tool failure is a result, not a crash of the worker
        message = str(exc) if not isinstance(exc, KeyError) else repr(exc.args[0]) if exc.args else ""
        return {"ok": False, "exception": f"{type(exc).__name__}: {message}" if message else type(exc).__name__}


def main():
    sys.path[0] = sys.argv[1]  # the suite's directory, not this script's
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # a tool's print() now goes to stderr
    sys.stdout = sys.stderr
    cache = {}
    for line in sys.stdin:
        channel.write(json.dumps(_answer(json.loads(line), cache)) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()
