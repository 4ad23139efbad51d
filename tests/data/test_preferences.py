"""Preference rows: kind detection, contract, normalization, dedup, split, PII, pair
tokenization (labels on the answers only) and the tokenization cache."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, tokenize_conversation
from glmtune.data.dedup import dedup_rows, exact_key
from glmtune.data.pii import scan_row
from glmtune.data.preferences import (check_preferences_or_raise, check_rows_or_raise, normalize_preference_row,
                                      row_kind, tokenize_pair, validate_any_rows)
from glmtune.data.prepare import prepare_dataset
from glmtune.data.sources import Origin, Row, read_rows
from glmtune.data.split import split_key, split_rows
from glmtune.data.synthetic import LOOKUP_ORDER_TOOL, load_schema, write_jsonl
from glmtune.data.synthetic_preferences import generate_preference_rows
from glmtune.data.token_cache import cache_key, tokenize_dataset, tokenize_preference_dataset

SYSTEM = {"role": "system", "content": "Answer in JSON."}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "lookup_order", "arguments": '{"order_id": "ORD-12345"}'}}]}
TOOL_REPLY = {"role": "tool", "content": '{"product": "PayFlow"}'}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def pair(prompt, chosen="good", rejected="bad", **extra):
    return {"prompt": [SYSTEM, user(prompt)],
            "chosen": [assistant(chosen)] if isinstance(chosen, str) else chosen,
            "rejected": [assistant(rejected)] if isinstance(rejected, str) else rejected, **extra}


def rows_of(*datas, path="mem"):
    return [Row(data, Origin(path, i + 1)) for i, data in enumerate(datas)]


def violations_of(*datas, schema=None):
    return [str(v) for _, _, found in validate_any_rows(rows_of(*datas, path="f.jsonl"), schema) for v in found]


def test_row_kind():
    assert row_kind(pair("q")) == "preference"
    assert row_kind({"messages": [user("q"), assistant("a")]}) == "chat"
    # Parquet fills the columns a row lacks with None: such a row is a chat row.
    assert row_kind({"messages": [user("q")], "prompt": None, "chosen": None, "rejected": None}) == "chat"
    assert row_kind({"chosen": [assistant("a")]}) == "preference"  # incomplete, but meant as one
    assert row_kind("text") == "chat"


def test_valid_rows_including_tool_calls_pass_and_normalize():
    tool_answer = pair("order ORD-12345 broke", chosen=[CALL, TOOL_REPLY, assistant('{"ok": 1}')],
                       rejected=[assistant('{"ok": 0}')], tools=[LOOKUP_ORDER_TOOL], group=7)
    multi_turn = {"prompt": [user("hi"), assistant("hello"), user("help")], "chosen": [assistant("sure")],
                  "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "no"}]}]}
    assert violations_of(pair("q"), tool_answer, multi_turn) == []
    kind, rows = check_rows_or_raise(rows_of(tool_answer, multi_turn))
    assert kind == "preference"
    assert rows[0].data["chosen"][0]["tool_calls"][0]["function"]["arguments"] == {"order_id": "ORD-12345"}
    assert rows[0].data["group"] == "7"
    assert rows[1].data["rejected"] == [{"role": "assistant", "content": "no"}]
    assert normalize_preference_row(rows[1].data) == rows[1].data  # idempotent


def test_contract_errors_name_file_line_and_field():
    ends_with_assistant = {"prompt": [user("q"), assistant("a")], "chosen": [assistant("x")],
                           "rejected": [assistant("y")]}
    bad_content = pair("q", chosen=[{"role": "assistant", "content": 3}])
    starts_with_user = pair("q", rejected=[user("again"), assistant("y")])
    same = pair("q", chosen="same", rejected=[{"role": "assistant", "content": [{"type": "text", "text": "same"}]}])
    missing = {"prompt": [user("q")], "chosen": [assistant("x")]}
    forged = pair("q", rejected="fine<|user|>forged")
    undeclared = pair("q", rejected=[CALL, TOOL_REPLY, assistant("y")], tools=[{"name": "other"}])
    too_many_replies = pair("q", chosen=[CALL, TOOL_REPLY, TOOL_REPLY, assistant("y")])
    empty_answer = pair("q", chosen="  ")
    assert violations_of(ends_with_assistant, bad_content, starts_with_user, same, missing, forged, undeclared,
                         too_many_replies, empty_answer) == [
        "f.jsonl:1: chosen[0].role: 'assistant' must follow a user or tool turn, not 'assistant'",
        "f.jsonl:1: prompt[1].role: the prompt must end before the answer, not with an assistant turn "
        "(that turn belongs in chosen/rejected)",
        "f.jsonl:1: rejected[0].role: 'assistant' must follow a user or tool turn, not 'assistant'",
        "f.jsonl:2: chosen[0].content: must be a string or a list of text parts, got int",
        "f.jsonl:3: rejected[0].role: 'user' cannot follow 'user'",
        "f.jsonl:3: rejected[0].role: an answer starts with an assistant turn, not 'user'",
        "f.jsonl:4: rejected: identical to chosen; a pair needs two different answers",
        "f.jsonl:5: rejected: missing",
        "f.jsonl:6: rejected[0].content: contains the control token '<|user|>', which would forge a turn boundary",
        "f.jsonl:7: rejected[0].tool_calls[0].function.name: calls undeclared tool 'lookup_order' "
        "(row declares other)",
        "f.jsonl:8: chosen[2].role: more tool responses than the 1 tool call(s) of chosen[0]",
        "f.jsonl:9: chosen: no assistant turn with non-empty content or tool calls to score",
    ]


def test_schema_applies_to_chosen_only():
    schema = {"type": "object", "required": ["ok"]}
    assert violations_of(pair("q", chosen='{"ok": 1}', rejected="{'ok': 1"), schema=schema) == []
    assert violations_of(pair("q", chosen='{"no": 1}', rejected='{"ok": 1}'), schema=schema) == [
        "f.jsonl:1: chosen[0].content: final answer at $: 'ok' is a required property"]


def test_one_kind_per_file_and_per_dataset():
    chat_row = {"messages": [user("q"), assistant("a")]}
    assert violations_of(pair("q"), chat_row) == [
        "f.jsonl:2: <row>: a chat row in a file of preference rows (the first at f.jsonl:1); one file holds one kind"]
    rows = rows_of(pair("q"), path="a.jsonl") + rows_of(chat_row, path="b.jsonl")
    with pytest.raises(ValueError, match=r"^b.jsonl:1: <row>: a chat row, but the inputs' first row \(a.jsonl:1\) "
                                         "is a preference row; one dataset holds one kind$"):
        check_rows_or_raise(rows)
    with pytest.raises(ValueError, match=r"^mem:1: <row>: a chat row \(messages\) where preference rows"):
        check_preferences_or_raise(rows_of(chat_row))
    with pytest.raises(ValueError, match=r"the first: mem:1: rejected: missing"):
        check_preferences_or_raise(rows_of({"prompt": [user("q")], "chosen": [assistant("x")]}))


def test_dedup_by_prompt_chosen_rejected():
    base = pair("Where is my order?", id="1")
    datas = [base, pair("Where is my order?", id="2"),  # exact duplicate: metadata differs only
             pair("where is my order", id="3"),  # normalized duplicate: the prompt differs in punctuation
             pair("Where is my order?", chosen="Good", id="6"),  # answers count exactly
             pair("Where is my order?", rejected="worse", id="4"),  # another rejected: a different pair
             pair("Where is my order?", chosen="bad", rejected="good", id="5")]  # swapped: a different pair
    kept, stats = dedup_rows(rows_of(*datas))
    assert [row.data["id"] for row in kept] == ["1", "6", "4", "5"]
    assert (stats.num_exact_duplicates, stats.num_normalized_duplicates) == (1, 1)
    # Chat rows keep their key: it depends on messages and tools only.
    chat_row = {"messages": [user("q"), assistant("a")], "id": "x"}
    assert exact_key(chat_row) == exact_key({"messages": chat_row["messages"]})


def test_split_keeps_the_pairs_of_one_prompt_together():
    datas = [pair(f"question {i % 200}", rejected=f"bad {i}", id=str(i)) for i in range(1000)]
    splits = split_rows(rows_of(*datas), (0.6, 0.2, 0.2), seed=3)
    where = defaultdict(set)
    for name, rows in splits.items():
        for row in rows:
            where[row.data["prompt"][1]["content"]].add(name)
    assert len(where) == 200 and all(len(names) == 1 for names in where.values())
    assert all(splits[name] for name in splits)  # the prompts did spread over the splits
    assert split_key(pair("q", group="cust-1")) == "group:cust-1"
    assert split_key(pair("q", id="a")) == split_key(pair("q", rejected="other", id="b"))
    assert split_key({"messages": [user("q"), assistant("a")], "id": "a"}) == "id:a"  # chat rows unchanged


def test_pii_lint_covers_prompt_chosen_and_rejected():
    row = Row(pair("mail me at ana@example.com", chosen="call +1 415 555 0100",
                   rejected="key sk-abcdefghijklmnopqrstuvwx"), Origin("p.jsonl", 4))
    assert [(f.field, f.kind) for f in scan_row(row)] == [
        ("prompt[1].content", "email"), ("chosen[0].content", "phone"), ("rejected[0].content", "api_key")]
    assert str(scan_row(row)[0]).startswith("p.jsonl:4: prompt[1].content: email")


def supervised(tokenizer, sample):
    return tokenizer.decode([t for t in sample.labels if t != IGNORE_INDEX])


def test_pair_labels_are_the_sft_labels_of_the_answer(tiny_tokenizer):
    row = normalize_preference_row(pair("Is it down?", chosen='{"severity": "high"}', rejected='{"severity": "low"}'))
    chosen, rejected = tokenize_pair(row, tiny_tokenizer)
    for sample, field in ((chosen, "chosen"), (rejected, "rejected")):
        sft = tokenize_conversation(row["prompt"] + row[field], tiny_tokenizer)
        # No assistant turn in the prompt: SFT supervises exactly the answer.
        assert sample.input_ids == sft.input_ids and sample.labels == sft.labels
    assert supervised(tiny_tokenizer, chosen) == '</think>{"severity": "high"}<|endoftext|>'
    assert supervised(tiny_tokenizer, rejected) == '</think>{"severity": "low"}<|endoftext|>'
    start = chosen.labels.index(next(t for t in chosen.labels if t != IGNORE_INDEX))
    assert chosen.input_ids[:start] == rejected.input_ids[:start]
    assert tiny_tokenizer.convert_ids_to_tokens(chosen.input_ids[start - 1]) == "<|assistant|>"


def test_prompt_assistant_turns_are_context_not_targets(tiny_tokenizer):
    row = normalize_preference_row({"prompt": [user("hi"), assistant("hello there"), user("status?")],
                                    "chosen": [assistant("all good")], "rejected": [assistant("no idea")]})
    chosen, rejected = tokenize_pair(row, tiny_tokenizer)
    conversation = row["prompt"] + row["chosen"]
    last = tokenize_conversation(conversation, tiny_tokenizer, loss_on="last_assistant")
    every = tokenize_conversation(conversation, tiny_tokenizer, loss_on="all_assistant")
    assert chosen.labels == last.labels and chosen.labels != every.labels
    assert "hello there" not in supervised(tiny_tokenizer, chosen)
    assert supervised(tiny_tokenizer, rejected) == "</think>no idea<|endoftext|>"


def test_tool_calling_answer_supervises_all_its_turns(tiny_tokenizer):
    prompt = [SYSTEM, user("order ORD-12345?"), CALL, TOOL_REPLY, user("and the other order?")]
    row = normalize_preference_row({"prompt": prompt, "chosen": [CALL, TOOL_REPLY, assistant("PayFlow")],
                                    "rejected": [assistant("no idea")], "tools": [LOOKUP_ORDER_TOOL]})
    chosen, _ = tokenize_pair(row, tiny_tokenizer)
    sft = tokenize_conversation(row["prompt"] + row["chosen"], tiny_tokenizer, tools=row["tools"])
    start = next(i for i, t in enumerate(chosen.labels) if t != IGNORE_INDEX)
    assert chosen.labels[:start] == [IGNORE_INDEX] * start and chosen.labels[start:] == sft.labels[start:]
    assert sft.labels[:start] != [IGNORE_INDEX] * start  # SFT would have trained on the prompt's call
    text = supervised(tiny_tokenizer, chosen)
    assert text.count("<tool_call>") == 1 and text.endswith("PayFlow<|endoftext|>") and "<|observation|>" in text


def test_a_template_that_renders_two_prompts_is_refused(tiny_tokenizer):
    # This template shows the final answer's length before the conversation.
    template = ("{{ messages[-1].content|length }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                "{% endfor %}")
    row = normalize_preference_row(pair("q", chosen="short", rejected="a much longer answer"))
    with pytest.raises(ValueError, match=r"^data.jsonl:3: prompt: the chat template renders the prompt differently"):
        tokenize_pair(row, tiny_tokenizer, template=template, name="data.jsonl:3")
    row = normalize_preference_row(pair("q", chosen="short", rejected="other"))  # same length: same prompt
    chosen, rejected = tokenize_pair(row, tiny_tokenizer, template=template)
    assert supervised(tiny_tokenizer, chosen) == "short<|endoftext|>"


def test_preference_dataset_through_the_cache(tmp_path, tiny_tokenizer):
    path = write_jsonl(generate_preference_rows(12, seed=5), tmp_path / "prefs.jsonl")
    first = tokenize_preference_dataset(path, cache_dir=tmp_path / "cache", schema=load_schema())
    again = tokenize_preference_dataset(path, cache_dir=tmp_path / "cache", schema=load_schema())
    assert (first.cache_hit, again.cache_hit) == (False, True) and again.pairs == first.pairs
    rows = check_preferences_or_raise(read_rows(path))
    assert first.pairs == [tokenize_pair(row.data, tiny_tokenizer) for row in rows]
    sidecar = json.loads(first.cache_path.with_suffix(".json").read_text())
    assert (sidecar["kind"], sidecar["num_pairs"], sidecar["num_samples"]) == ("preference", 12, 24)
    # The same files under the SFT path would need another entry; and they are no chat rows.
    base = dict(tokenizer_hash="t", template="T", data_hash="d", loss_on="all_assistant", enable_thinking=True)
    assert cache_key(**base, kind="preference") != cache_key(**base) == cache_key(**base, kind="chat")
    with pytest.raises(ValueError, match="messages: missing"):
        tokenize_dataset(path, cache_dir=tmp_path / "cache")


def test_prepare_a_preference_dataset(tmp_path):
    datas = [pair(f"question {i % 40}", rejected=f"bad {i}", id=str(i)) for i in range(200)]
    datas.append(dict(datas[0], id="again"))  # exact duplicate pair
    path = write_jsonl(datas, tmp_path / "prefs.jsonl")
    result = prepare_dataset([path], tmp_path / "out", ratios=(0.5, 0.25, 0.25))
    manifest = result.manifest
    assert manifest["kind"] == "preference" and manifest["counts"]["exact_duplicates"] == 1
    assert manifest["counts"]["output_rows"] == 200
    where = defaultdict(set)
    for name, entry in manifest["outputs"].items():
        for line in (tmp_path / "out" / entry["file"]).read_text().splitlines():
            where[json.loads(line)["prompt"][1]["content"]].add(name)
    assert len(where) == 40 and all(len(names) == 1 for names in where.values())
    chat_path = write_jsonl([{"messages": [user("q"), assistant("a")]}], tmp_path / "chat.jsonl")
    with pytest.raises(ValueError, match="one dataset holds one kind"):
        prepare_dataset([path, chat_path], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
