"""Run a test module's checks in Triton's CPU interpreter.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is imported, which
another test in the same worker may already have done; so the checks run in another process
that executes the module as a script. That process is forked, one per module, from a server
this test process starts once (`python triton_interpreter.py --serve`): the server imports
torch and triton under the interpreter, which a fresh interpreter would spend seconds on for
every module, and each module's checks still start from that clean state (a fork: no module
sees what another one changed).
"""

import atexit
import json
import os
import runpy
import select
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
_server: subprocess.Popen | None = None


def _started_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
        _server = subprocess.Popen([sys.executable, __file__, "--serve"], env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        atexit.register(_server.stdin.close)  # the server ends at the end of its input
    return _server


def run_checks_in_interpreter(module_file: str) -> list[str]:
    """Runs `python module_file` under the interpreter; returns the names it printed."""
    server = _started_server()
    server.stdin.write(module_file + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], TIMEOUT_S)
    if not ready:
        server.kill()
        raise TimeoutError(f"{module_file}: no result after {TIMEOUT_S} s in the interpreter")
    line = server.stdout.readline()
    assert line, f"the interpreter server ended (exit status {server.wait()})"
    done = json.loads(line)
    assert done["returncode"] == 0, done["stdout"] + done["stderr"]
    return done["stdout"].split()


def _run_module(module_file: str, stdout: str, stderr: str) -> int:
    """In the forked child: `python module_file`, its output into the files `stdout` and `stderr`."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module_file]
    sys.path.insert(0, str(Path(module_file).parent))  # as for a script: its directory first
    try:
        runpy.run_path(module_file, run_name="__main__")
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _serve() -> None:
    import torch  # noqa: F401  # what every module's checks import, once
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    for line in sys.stdin:
        module_file = line.strip()
        with tempfile.TemporaryDirectory() as tmp:
            stdout, stderr = f"{tmp}/stdout", f"{tmp}/stderr"
            sys.stdout.flush()  # nothing buffered for the child to write again
            pid = os.fork()
            if pid == 0:
                os._exit(_run_module(module_file, stdout, stderr))
            _, status = os.waitpid(pid, 0)
            result = {"returncode": os.waitstatus_to_exitcode(status), "stdout": Path(stdout).read_text(),
                      "stderr": Path(stderr).read_text()}
        print(json.dumps(result), flush=True)


def main(*checks) -> None:
    """The child side: run each check, printing its name once it passed."""
    for check in checks:
        check()
        print(check.__name__)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
