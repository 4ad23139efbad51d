"""Run a test module's checks in Triton's CPU interpreter.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is imported, which
another test in the same worker may already have done; so the checks run in a child
process that executes the module as a script.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_checks_in_interpreter(module_file: str) -> list[str]:
    """Runs `python module_file` under the interpreter; returns the names it printed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, module_file], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


def main(*checks) -> None:
    """The child side: run each check, printing its name once it passed."""
    for check in checks:
        check()
        print(check.__name__)
