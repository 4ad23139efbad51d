"""Eval under each chat format: where generation stops, where the reference loss starts, what the
transcript shows between two generated turns, and the refusal of a template glmtune cannot read.

Stop ids (what `backends.LocalModel` hands `generate`) are the format's: GLM's <|endoftext|>,
<|user|>, <|observation|> as before; ChatML's <|im_end|>, <|endoftext|>; Llama-3's <|eot_id|>,
<|eom_id|>, <|end_of_text|>; a template known only by its generation blocks, the tokenizer's eos and
the special token its block puts after the answer. The reference loss covers the turns after the
last user turn, found by the format's user-turn opening (ChatML's tool results are user turns
that open with <tool_response>: not a boundary).
"""

from __future__ import annotations

import pytest

from glmtune.data.chat_template import IGNORE_INDEX, load_chat_template
from glmtune.data.contract import normalize_row
from glmtune.data.synthetic import generate_rows
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.eval.answering import Prompting, _continue, _Request
from glmtune.eval.backends import Turn
from glmtune.eval.endpoint import Endpoint, EndpointOptions, resolve_endpoint
from glmtune.eval.scorers import EvalRow
from glmtune.eval.scorers.reference_loss import reference_labels
from glmtune.eval.suite import DecodingConfig
from glmtune.eval.tool_calls import ParsedCall
from glmtune.eval.tools import ToolExecutor
from tests.data.chat_format_fixtures import CONVERSATION, TOOL, build_tokenizer
from tests.eval.hostile_stub import Server, completion

STOPS = {
    "glm": ("<|endoftext|>", "<|user|>", "<|observation|>"),
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "llama3_1": ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
    "gemma_training": ("<eos>", "<end_of_turn>"),
}
MESSAGES = CONVERSATION["messages"]
# The reference after the last user turn, when it calls a tool first (the row ends at "It shipped.",
# its prompt at "Where is order 7?") and when the prompt holds an earlier exchange (it ends at
# "Thanks!"), with thinking on.
REPLIES = {
    "glm": ("</think><tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>7</arg_value></tool_call>"
            "<|observation|></think>It shipped.<|endoftext|>",
            # GLM's boundary is the last <|user|> token, the target that ends the turn before it (as it was)
            "<|user|><think>Be polite.</think>You're welcome.<|endoftext|>"),
    # Qwen3's template gives the last turn (only) after the last user turn its think block.
    "qwen3": ('<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "7"}}\n</tool_call><|im_end|>'
              "<think>\n\n</think>\n\nIt shipped.<|im_end|>",
              "<think>\nBe polite.\n</think>\n\nYou're welcome.<|im_end|>"),
    "llama3_1": ('{"name": "lookup_order", "parameters": {"order_id": "7"}}<|eot_id|>It shipped.<|eot_id|>',
                 "You're welcome.<|eot_id|>"),
}


@pytest.fixture(scope="module")
def prompting(tmp_path_factory):
    """format name -> a Prompting with that format's tokenizer and template (thinking on)."""
    root = tmp_path_factory.mktemp("prompting")
    out = {"glm": Prompting(load_tokenizer(None), load_chat_template(TINY_TOKENIZER_DIR), True, DecodingConfig())}
    for name in ("qwen3", "llama3_1", "gemma_training", "gemma"):
        build_tokenizer(root / name, name)
        out[name] = Prompting(load_tokenizer(root / name), load_chat_template(root / name), True, DecodingConfig())
    return out


def _row(prompt_end: int, end: int | None = None, messages=MESSAGES, tools=(TOOL,)) -> EvalRow:
    messages = messages[:end]
    return EvalRow("s", "r", "c", "rows.jsonl:1", {"messages": messages}, messages[:prompt_end], list(tools) or None,
                   None, [], messages[prompt_end:])


@pytest.mark.parametrize("name", list(STOPS))
def test_generation_stops_at_the_formats_end_of_turn_tokens(prompting, name):
    p = prompting[name]
    assert p.stop_tokens == STOPS[name]
    assert p.stop_ids == {p.tokenizer.convert_tokens_to_ids(token) for token in STOPS[name]}
    assert len(p.stop_ids) == len(STOPS[name]) and p.tokenizer.unk_token_id not in p.stop_ids


@pytest.mark.parametrize("name", list(REPLIES))
def test_the_reference_loss_covers_the_turns_after_the_last_user_turn(prompting, name):
    p = prompting[name]
    for (prompt_end, end), reply in zip(((2, 5), (6, None)), REPLIES[name]):
        ids, labels = reference_labels(_row(prompt_end, end), p)
        assert p.tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == reply
        first = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
        assert labels[first:] == [t if label != IGNORE_INDEX else IGNORE_INDEX for t, label in
                                  zip(ids[first:], labels[first:])]


def test_a_template_known_by_its_blocks_scores_the_blocks_after_the_last_user_turn(prompting):
    p = prompting["gemma_training"]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye"}]
    _, labels = reference_labels(_row(3, None, messages, ()), p)
    assert p.tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "Goodbye<end_of_turn>\n"


def test_a_template_of_unknown_turns_is_refused_when_prompts_are_rendered(prompting):
    p = prompting["gemma"]
    with pytest.raises(ValueError, match=r"chat_template.jinja: the chat template is not of a turn format glmtune "
                                         r"knows \(GLM, ChatML, Llama-3\) and marks no assistant text with"):
        p.render(MESSAGES[1:2], None)


def test_the_transcript_shows_tool_turns_as_the_template_renders_them(prompting, tmp_path):
    """ChatML: after a tool-call turn the transcript reads the tool result as Qwen3's template writes
    it (a user turn holding <tool_response>) and the next assistant opening; the next prompt is the
    training conversation's."""
    p = prompting["qwen3"]
    row = next(normalize_row(r) for r in generate_rows(50, seed=3) if r["category"] == "tool_call")
    eval_row = EvalRow("t", row["id"], "tool_call", "x:1", row, row["messages"][:2], row["tools"], None, [],
                       row["messages"][2:])
    request = _Request(eval_row, list(eval_row.prompt))
    [call] = row["messages"][2]["tool_calls"]
    turn = Turn("", "stop_token", 0, 0.0, calls=[ParsedCall(call["function"]["name"], call["function"]["arguments"])])
    with ToolExecutor({"lookup_order": "glmtune.data.synthetic:lookup_order"}, 10, tmp_path) as executor:
        assert _continue(request, turn, True, executor, p)
    assert request.messages == row["messages"][:4]
    assert request.pieces == [f"\n<|im_start|>user\n<tool_response>\n{row['messages'][3]['content']}\n"
                              "</tool_response><|im_end|>\n<|im_start|>assistant\n"]
    assert p.render(request.messages, row["tools"]) == p.render(row["messages"][:4], row["tools"])


def test_an_engine_answer_holding_the_formats_end_of_turn_is_cut_there(prompting):
    """--api completions: an engine that keeps special tokens returns the turn's end and what it
    went on to write; the answer is cut at the template's stop token, ChatML's <|im_end|> here."""
    options = EndpointOptions(concurrency=1)
    with Server({"order 7": completion("Shipped.<|im_end|>\n<|im_start|>user\nmore")}) as server:
        endpoint = Endpoint(resolve_endpoint(server.url, "candidate", options), options)
        try:
            [turn], _ = endpoint.answer([(MESSAGES[1:2], None)], prompting["qwen3"], 0)
        finally:
            endpoint.close()
    assert turn.text == "Shipped."
