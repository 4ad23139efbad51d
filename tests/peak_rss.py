"""The peak resident memory of Python code run in a fresh interpreter: the memory-bound tests of
the streaming merge and export (tests/peft/test_merge_stream.py, tests/checkpoint/test_export_stream.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Appended to the code measured: VmHWM is the process's own peak (ru_maxrss would carry the forking
# pytest process's over exec).
PEAK = "import re; print('PEAK', int(re.search(r'VmHWM:\\s*(\\d+) kB', open('/proc/self/status').read())[1]) * 1024)"


def peak_rss(code: str) -> int:
    """Bytes: the peak RSS of `python -c code` (code ending with PEAK), run from the repository root."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("PEAK")[-1])
