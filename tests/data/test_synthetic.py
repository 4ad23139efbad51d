"""The bundled synthetic task: deterministic, valid, learnable."""

from __future__ import annotations

import json
import time

from glmtune.data.contract import validate_rows
from glmtune.data.sources import Origin, Row
from glmtune.data.synthetic import ISSUES, PRODUCTS, SCHEMA_PATH, generate_rows, load_schema


def test_deterministic_per_seed():
    assert generate_rows(200, seed=4) == generate_rows(200, seed=4)
    assert generate_rows(200, seed=4) != generate_rows(200, seed=5)


def test_rows_pass_the_contract_with_the_schema():
    rows = [Row(data, Origin("synth", i)) for i, data in enumerate(generate_rows(1000, seed=0))]
    assert validate_rows(rows, load_schema()) == []
    assert json.loads(SCHEMA_PATH.read_text())["required"] == ["product", "severity", "next_action"]


def test_tool_subset_and_groups():
    rows = generate_rows(2000, seed=0)
    tool_rows = [r for r in rows if any(m.get("tool_calls") for m in r["messages"])]
    assert 0.17 < len(tool_rows) / len(rows) < 0.23
    for row in tool_rows:
        call = row["messages"][2]["tool_calls"][0]["function"]
        assert call["name"] == "lookup_order" and isinstance(call["arguments"], dict)
        assert call["arguments"]["order_id"] in row["messages"][1]["content"]
        assert row["tools"][0]["function"]["name"] == "lookup_order"
    groups = [r["group"] for r in rows]
    assert len(set(groups)) < len(groups) / 2  # customers have several tickets
    assert len({r["id"] for r in rows}) == len(rows)


def test_answer_is_a_function_of_ticket_keywords():
    for row in generate_rows(1000, seed=9):
        ticket = row["messages"][1]["content"]
        answer = json.loads(row["messages"][-1]["content"])
        # The product is named in the ticket, or else it comes from the tool response.
        source = ticket if answer["product"] in ticket else row["messages"][3]["content"]
        assert [p for p in PRODUCTS if p in source] == [answer["product"]]
        categories = [c for c, (_, _, phrasings) in ISSUES.items()
                      if any(p.split("{p}")[0].lower() in ticket.lower() and p.split("{p}")[-1] in ticket
                             for p in phrasings)]
        assert len(categories) == 1
        severity, next_action, _ = ISSUES[categories[0]]
        assert (answer["severity"], answer["next_action"]) == (severity, next_action)


def test_generation_is_fast():
    start = time.perf_counter()
    generate_rows(2000, seed=1)
    assert time.perf_counter() - start < 2.0


def test_lookup_order_is_the_tool_and_every_order_id_belongs_to_its_product():
    import re

    import pytest

    from glmtune.data.synthetic import lookup_order

    rows = generate_rows(1000, seed=2)
    for row in rows:
        answer = json.loads(row["messages"][-1]["content"])
        for order_id in re.findall(r"ORD-\d+", row["messages"][1]["content"]):
            assert lookup_order(order_id)["product"] == answer["product"]
        if len(row["messages"]) == 5:  # the tool-calling subset: the response is the function's result
            order_id = row["messages"][2]["tool_calls"][0]["function"]["arguments"]["order_id"]
            assert json.loads(row["messages"][3]["content"]) == lookup_order(order_id)
            assert row["category"] == "tool_call"
        else:
            assert row["category"] in ISSUES
    assert lookup_order("ORD-10005") == {"order_id": "ORD-10005", "product": PRODUCTS[10005 % 6],
                                         "plan": "enterprise", "status": "cancelled"}
    for bad in ("ORD-1234", "ORD-01234", "ord-12345", "ORD-12a45", 12345):
        with pytest.raises(KeyError):
            lookup_order(bad)
