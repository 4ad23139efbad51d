"""The bundled preference task: deterministic, contract-clean, one corruption per row."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from glmtune.data.preferences import check_preferences_or_raise
from glmtune.data.sources import Origin, Row
from glmtune.data.synthetic import NEXT_ACTIONS, SEVERITIES, generate_rows, load_schema
from glmtune.data.synthetic_preferences import REJECTED_KINDS, generate_preference_rows


def test_same_seed_same_rows_and_the_seed_matters():
    assert generate_preference_rows(60, seed=4) == generate_preference_rows(60, seed=4)
    assert generate_preference_rows(60, seed=4) != generate_preference_rows(60, seed=5)
    assert generate_preference_rows(0) == []


def test_rows_pass_the_contract_with_the_answer_schema():
    rows = generate_preference_rows(300, seed=1)
    checked = check_preferences_or_raise([Row(row, Origin("synth", i + 1)) for i, row in enumerate(rows)],
                                         load_schema())
    assert len(checked) == 300


def test_prompt_and_chosen_come_from_the_sft_row():
    sft, prefs = generate_rows(200, seed=3), generate_preference_rows(200, seed=3)
    num_tool_rows = 0
    for source, row in zip(sft, prefs):
        assert row["prompt"] == source["messages"][:-1] and row["chosen"] == source["messages"][-1:]
        assert (row["group"], row["category"], row.get("tools")) == (source["group"], source["category"],
                                                                      source.get("tools"))
        if row["category"] == "tool_call":  # the call and its response are prompt: preference on the answer
            num_tool_rows += 1
            assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "tool"]
            assert row["prompt"][2]["tool_calls"][0]["function"]["name"] == "lookup_order"
    assert num_tool_rows > 20


@pytest.mark.parametrize("seed", [0, 7])
def test_rejected_answers_are_plausibly_wrong(seed):
    rows = generate_preference_rows(120, seed=seed)
    assert [row["rejected_kind"] for row in rows] == [REJECTED_KINDS[i % 3] for i in range(120)]
    invalid_forms = Counter()
    for row in rows:
        chosen = json.loads(row["chosen"][0]["content"])
        text = row["rejected"][0]["content"]
        assert row["rejected"][0]["role"] == "assistant" and text != row["chosen"][0]["content"]
        if row["rejected_kind"] == "invalid_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
            invalid_forms["single_quotes" if "'" in text else "truncated"] += 1
            continue
        rejected = json.loads(text)
        field = "severity" if row["rejected_kind"] == "wrong_severity" else "next_action"
        assert {k for k in chosen if chosen[k] != rejected[k]} == {field}
        assert rejected[field] in (SEVERITIES if field == "severity" else NEXT_ACTIONS)
    assert invalid_forms["single_quotes"] == invalid_forms["truncated"] == 20
