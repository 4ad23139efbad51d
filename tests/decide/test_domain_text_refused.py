"""`glmtune decide` refuses a suite with a domain_text set (eval's continued-pretraining set) in one
line before anything loads, rather than scoring it as nothing (null metrics, failing gates)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from glmtune.cli import main

SUITE = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "eval_cpt_domain_text.yaml"


def test_a_domain_text_suite_is_refused(tmp_path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["decide", str(SUITE), "--base", str(tmp_path / "no-model"), "--out", str(tmp_path / "d")])
    assert code == 2
    assert f"{SUITE}: domain_text: decide compares ways to serve a task" in err.getvalue()
    assert not (tmp_path / "d").exists()
