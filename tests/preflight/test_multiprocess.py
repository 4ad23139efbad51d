"""Check 10: a multi-process run whose loss differs from the one-process run (it trains at another
learning rate), and a machine with one process."""

from __future__ import annotations

from glmtune.preflight.multiprocess import check_multiprocess


def test_differing_multi_process_loss_fails(sft_done, fresh):
    result = check_multiprocess(fresh(), sft_done.reference(), "--optim.lr", "5e-3")
    assert result.status == "fail"
    assert result.message.startswith("2 processes: dp 2: step 2 loss")
    steps = result.evidence["steps"]
    assert steps[0]["loss"] == steps[0]["reference_loss"]  # before the first update they agree


def test_one_process_is_skipped_and_says_why(sft_done, fresh):
    result = check_multiprocess(fresh(nproc=1), sft_done.reference())
    assert result.status == "skip" and "a multi-process run needs 2" in result.skip_reason
