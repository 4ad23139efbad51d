"""One model answers one set's prompts: batched generation with the tool-call loop.

Each round renders every pending request with the chat template (the suite's system prompt and
thinking switch already applied to its messages), decodes them in left-padded batches of
`decoding.batch_size` (`glmtune.generation.generate`, stop ids <|endoftext|>, <|user|>,
<|observation|> as in training samples), and parses the GLM-5 tool calls in each output:

  * no call: the output is the request's answer;
  * calls, and fewer than `max_tool_rounds` rounds executed: each call is validated and run
    (`tools.ToolExecutor`), the assistant's call turn and the tool turns are appended, and the
    request takes part in the next round;
  * calls in the last allowed round: they are recorded as not executed and the visible text
    before them is the answer ("tool_rounds_exhausted");
  * a call that does not parse (unclosed, no name): recorded as failed, the text before it is
    the answer ("bad_tool_call").

Sampling seeds derive from `decoding.seed`, the set's index, the round and the batch, so every
model sees the same seed for the same first-round batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from glmtune.data.chat_template import render_conversation
from glmtune.data.tokenizer import CHAT_STOP_TOKENS
from glmtune.eval.scorers.base import EvalRow, ModelOutput, ToolCall
from glmtune.eval.suite import DecodingConfig
from glmtune.eval.tool_calls import parse_tool_calls
from glmtune.eval.tools import ToolExecutor, tool_response
from glmtune.generation import generate

@dataclass
class Prompting:
    """What every model shares: tokenizer, template, thinking switch and decoding."""

    tokenizer: Any
    template: str
    enable_thinking: bool
    decoding: DecodingConfig

    @property
    def stop_ids(self) -> set[int]:
        return {self.tokenizer.convert_tokens_to_ids(token) for token in CHAT_STOP_TOKENS}

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = render_conversation(messages, tools=tools, template=self.template,
                                   enable_thinking=self.enable_thinking, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class _Request:
    row: EvalRow
    messages: list[dict[str, Any]]
    pieces: list[str] = field(default_factory=list)  # the transcript
    calls: list[ToolCall] = field(default_factory=list)
    latency_s: float = 0.0
    tokens: int = 0
    output: ModelOutput | None = None

    def finish(self, text: str, how: str) -> None:
        self.output = ModelOutput(text, "".join(self.pieces), self.calls, self.latency_s, self.tokens, how)


def run_rows(model, rows: list[EvalRow], prompting: Prompting, executor: ToolExecutor | None,
             set_index: int) -> tuple[list[ModelOutput], float]:
    """Every row's output, and the summed wall time of the generate calls."""
    d = prompting.decoding
    requests = [_Request(row, list(row.prompt)) for row in rows]
    pending = list(range(len(requests)))
    generate_s = 0.0
    for round_index in range(d.max_tool_rounds + 1):
        next_pending = []
        for batch_index, start in enumerate(range(0, len(pending), d.batch_size)):
            batch_ids = pending[start:start + d.batch_size]
            prompts = [prompting.render(requests[i].messages, requests[i].row.tools) for i in batch_ids]
            began = time.perf_counter()
            result = generate(model, prompts, d.max_new_tokens, tokenizer=prompting.tokenizer,
                              temperature=d.temperature, top_k=d.top_k, top_p=d.top_p,
                              seed=d.seed + 1_000_003 * set_index + 10_007 * round_index + batch_index,
                              stop_token_ids=prompting.stop_ids, stop_strings=d.stop_strings)
            seconds = time.perf_counter() - began
            generate_s += seconds
            for i, text, ids, reason in zip(batch_ids, result.texts, result.token_ids, result.finish_reasons):
                request = requests[i]
                request.latency_s += seconds
                request.tokens += len(ids)
                request.pieces.append(text)
                if _continue(request, text, reason, round_index < d.max_tool_rounds, executor):
                    next_pending.append(i)
        pending = next_pending
        if not pending:
            break
    assert all(r.output is not None for r in requests)
    return [r.output for r in requests], generate_s


def _continue(request: _Request, text: str, reason: str, may_call: bool, executor: ToolExecutor | None) -> bool:
    """Handle one generated turn; True when the request goes on to another round."""
    content, parsed = parse_tool_calls(text, request.row.tools)
    if not parsed:
        request.finish(text, "length" if reason == "length" else "answer")
        return False
    if any(call.error for call in parsed):
        request.calls += [ToolCall(c.name, c.arguments, False, None, c.error or "not executed: another call of "
                                   "this turn does not parse") for c in parsed]
        request.finish(content, "bad_tool_call")
        return False
    if not may_call or executor is None:
        why = "no tools are registered" if executor is None else "max_tool_rounds reached"
        request.calls += [ToolCall(c.name, c.arguments, False, None, f"not executed: {why}") for c in parsed]
        request.finish(content, "tool_rounds_exhausted")
        return False
    executed = [executor.run(c.name, c.arguments, request.row.tools) for c in parsed]
    request.calls += executed
    request.messages = request.messages + [
        {"role": "assistant", "content": content,
         "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed]},
        *({"role": "tool", "content": tool_response(call)} for call in executed)]
    request.pieces.append("\n<|observation|>" + "".join(f"<tool_response>{tool_response(call)}</tool_response>"
                                                       for call in executed) + "\n<|assistant|>")
    return True
