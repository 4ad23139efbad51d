"""Check 7 with a broken resume: the killed run's checkpoint has its data position moved on
and its token count with it (checksums rewritten, as a buggy save would leave it: the reader's
checks find it consistent), so the resumed step reads other rows."""

from __future__ import annotations

import json

from glmtune.checkpoint.integrity import write_checksums
from glmtune.preflight.resume import check_resume


def test_moved_data_position_fails_the_resume(sft_done, fresh):
    def move_data_position(checkpoint):
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        assert state["loader"]["epoch"] == 0  # so the cursor counts the micro-batches drawn
        # Its token count moved with it: a save that agrees with itself, which only the losses tell.
        state["tokens_seen"] += state["tokens_seen"] // state["loader"]["cursor"]
        state["loader"]["cursor"] += 1
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        write_checksums(checkpoint)

    result = check_resume(fresh(), sft_done.reference(), tamper=move_data_position)
    assert result.status == "fail"
    assert result.message.startswith("after resuming: step 2 loss")
    assert result.evidence["resumed"].startswith("resumed from") and result.evidence["killed"].startswith("SIGKILL")
    assert result.evidence["steps"][0]["loss"] == result.evidence["steps"][0]["reference_loss"]  # step 1 agreed
