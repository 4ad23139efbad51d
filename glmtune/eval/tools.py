"""Executing tool calls: argument validation against the row's tool schema, then the registered
Python function in a separate process with a timeout.

    executor = ToolExecutor({"lookup_order": "glmtune.data.synthetic:lookup_order"}, timeout_s=10,
                            search_dir=suite_dir)
    executor.check()                                   # every function imports: else a ValueError
    call = executor.run("lookup_order", {"order_id": "ORD-10005"}, row_tools)   # a ToolCall
    executor.close()

A function runs in one long-lived worker process (`tool_worker.py`, started with this Python):
a function that hangs is killed at `timeout_s` and a function that crashes the interpreter
(segfault, `os._exit`) only ends the worker; either way the call fails with a reason and the
next call starts a fresh worker. Exceptions come back as "Type: message". A result longer than
MAX_RESULT_CHARS fails the call too (it would become a tool turn no prompt can hold). Evaluation
never hangs on, or dies with, a tool. Functions are imported with the suite file's directory first
on `sys.path`.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema

from glmtune.eval.scorers.base import ToolCall

_WORKER = Path(__file__).with_name("tool_worker.py")
MAX_RESULT_CHARS = 1 << 20  # one answer line of the worker: the result as JSON text


class ToolExecutor:
    def __init__(self, functions: dict[str, str], timeout_s: float, search_dir: Path) -> None:
        self.functions = dict(functions)
        self.timeout_s = timeout_s
        self.search_dir = Path(search_dir)
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._proc is not None:
            proc, self._proc = self._proc, None
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                stream.close()

    def _start(self) -> subprocess.Popen:
        if self._proc is None:
            # Unbuffered (-u), no user site: the worker sees the venv's packages and the suite's directory.
            self._proc = subprocess.Popen([sys.executable, "-u", "-s", str(_WORKER), str(self.search_dir)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True, encoding="utf-8")
        return self._proc

    def _request(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The worker's answer, or {"ok": False, "error": ...} if it timed out or died."""
        proc = self._start()
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died(proc)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                return {"ok": False, "error": f"timed out after {timeout_s:g} s (killed)"}
            ready, _, _ = select.select([proc.stdout], [], [], remaining)
            if ready:
                line = proc.stdout.readline(MAX_RESULT_CHARS + 1)
                if len(line) > MAX_RESULT_CHARS:  # the rest of the line is still in the pipe: a fresh worker
                    self.close()
                    return {"ok": False, "error": f"the result is longer than {MAX_RESULT_CHARS:,} characters "
                                                  "(MAX_RESULT_CHARS)"}
                return json.loads(line) if line else self._died(proc)

    def _died(self, proc: subprocess.Popen) -> dict[str, Any]:
        code = proc.wait()
        self._proc = None
        return {"ok": False, "error": f"the tool process exited (code {code}) while running the call"}

    def check(self) -> None:
        """Every registered function imports and is callable, else a ValueError naming it."""
        for name, ref in self.functions.items():
            # Importing can be slow (a module that imports torch): a generous fixed limit.
            answer = self._request({"function": ref, "check": True}, max(self.timeout_s, 60.0))
            if not answer["ok"]:
                raise ValueError(f"tools.functions.{name}: cannot use {ref}: "
                                 f"{answer.get('exception') or answer['error']}")

    def run(self, name: str, arguments: Any, row_tools: list[dict[str, Any]] | None) -> ToolCall:
        """Validate and execute one call as a row offers it (`row_tools`: the row's tool specs)."""
        spec = next((t.get("function", t) for t in row_tools or [] if t.get("function", t).get("name") == name),
                    None)
        if spec is None:
            offered = ", ".join(t.get("function", t).get("name", "?") for t in row_tools or []) or "none"
            return ToolCall(name, arguments, False, None, f"the prompt offers no tool {name!r} (offered: {offered})")
        if name not in self.functions:
            return ToolCall(name, arguments, False, None, f"no function is registered for tool {name!r} in the suite")
        schema = spec.get("parameters") or {"type": "object"}
        validator = jsonschema.validators.validator_for(schema)
        try:
            validator.check_schema(schema)  # else validating raises (an unknown type such as "strin")
        except jsonschema.SchemaError as exc:
            return ToolCall(name, arguments, False, None, f"the prompt's parameters schema of {name!r} is not a "
                                                          f"valid JSON Schema: {exc.message}")
        problems = sorted(validator(schema).iter_errors(arguments), key=lambda e: list(e.absolute_path))
        if problems:
            return ToolCall(name, arguments, False, None, f"invalid arguments: {problems[0].message}")
        answer = self._request({"function": self.functions[name], "arguments": arguments}, self.timeout_s)
        if answer["ok"]:
            return ToolCall(name, arguments, True, answer["result"], None)
        error = f"raised {answer['exception']}" if "exception" in answer else answer["error"]
        return ToolCall(name, arguments, False, None, error)


def tool_response(call: ToolCall) -> str:
    """What the tool turn shows the model: the result, or the error as a JSON object."""
    return call.result if call.ok else json.dumps({"error": call.error}, ensure_ascii=False)
