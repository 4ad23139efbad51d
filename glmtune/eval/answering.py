"""One model answers one set's prompts: batched generation with the tool-call loop.

Each round hands every pending request (its messages, the suite's system prompt and thinking
switch already applied) to the backend in batches (`backends.py`: a local model renders them
with the chat template and decodes left-padded batches of `decoding.batch_size`, stopping at
the template's turn-format stop tokens: GLM's <|endoftext|>, <|user|>, <|observation|>, ChatML's
<|im_end|>, Llama-3's <|eot_id|>; data/turn_formats.py), and parses the tool calls in each
output in the template's format (GLM-5's, ChatML's `<tool_call>{json}`, Llama-3's JSON:
tool_call_formats.py), or takes the calls an engine's chat API parsed:

  * no call: the output is the request's answer;
  * calls, and fewer than `max_tool_rounds` rounds executed: each call is validated and run
    (`tools.ToolExecutor`), the assistant's call turn and the tool turns are appended, and the
    request takes part in the next round;
  * calls in the last allowed round: they are recorded as not executed and the visible text
    before them is the answer ("tool_rounds_exhausted");
  * a call that does not parse (unclosed, no name, an argument nested too deep): recorded as
    failed, the text before it is the answer ("bad_tool_call").

A request that fails on its own (its prompt does not render, its generation raises, handling
its turn raises) ends with finish "error" and the reason in `ModelOutput.error`; the other
requests go on. Only when every request of the set fails in generation is the
exception raised: then the model, not a request, is broken (`glmtune eval` exits 3).

Sampling seeds derive from `decoding.seed`, the set's index, the round and the batch, so every
model sees the same seed for the same first-round batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from glmtune.data.chat_generation import stop_token_ids, stop_tokens, tool_turns_text
from glmtune.data.chat_template import chat_format, render_conversation
from glmtune.data.turn_formats import GLM, check_tokenizer
from glmtune.eval.scorers.base import EvalRow, ModelOutput, ToolCall
from glmtune.eval.suite import DecodingConfig
from glmtune.distributed.lockstep import ONE_PROCESS
from glmtune.eval.backends import Backend, Failed, Turn
from glmtune.eval.tool_call_formats import parser_for
from glmtune.eval.tool_calls import parse_tool_calls
from glmtune.eval.tools import ToolExecutor, tool_response
from glmtune.io.text_limits import printable

@dataclass
class Prompting:
    """What every model shares: tokenizer, template, thinking switch and decoding."""

    tokenizer: Any
    template: str
    enable_thinking: bool
    decoding: DecodingConfig

    @property
    def stop_tokens(self) -> tuple[str, ...]:
        """Where a generated assistant turn ends: the template's turn format's stop tokens
        (GLM: <|endoftext|>, <|user|>, <|observation|>; ChatML: <|im_end|>, ...)."""
        return stop_tokens(self.tokenizer, self.template)

    @property
    def stop_ids(self) -> set[int]:
        return stop_token_ids(self.tokenizer, self.template)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The prompt's ids; a template whose turns glmtune cannot tell is refused here (the rows'
        prompts are rendered before a model loads) as it is when training data is tokenized."""
        text = render_conversation(messages, tools=tools, template=self.template, tokenizer=self.tokenizer,
                                   enable_thinking=self.enable_thinking, add_generation_prompt=True)
        check_tokenizer(chat_format(self.template), self.tokenizer, self.template)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _tool_turns(prompting: Prompting | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                executed: list[ToolCall]) -> str:
    """The transcript's piece after a tool-call turn: the tool results and the next turn's opening,
    as the template renders them (GLM's as its transcripts have always read; also without a
    `prompting`, as tests of the loop call it)."""
    if prompting is None or chat_format(prompting.template).turns is GLM:
        return "\n<|observation|>" + "".join(f"<tool_response>{tool_response(call)}</tool_response>"
                                             for call in executed) + "\n<|assistant|>"
    return tool_turns_text(messages, prompting.tokenizer, tools=tools, template=prompting.template,
                           enable_thinking=prompting.enable_thinking)


@dataclass
class _Request:
    row: EvalRow
    messages: list[dict[str, Any]]
    pieces: list[str] = field(default_factory=list)  # the transcript
    calls: list[ToolCall] = field(default_factory=list)
    latency_s: float = 0.0
    tokens: int = 0
    turn: Turn | None = None  # the last round's
    output: ModelOutput | None = None
    generation_error: BaseException | None = None
    keeps_traceback: bool = False  # the first request's error is raised when every one fails

    def finish(self, text: str, how: str, error: str | None = None) -> None:
        self.output = ModelOutput(text, "".join(self.pieces), self.calls, self.latency_s, self.tokens, how, error=error)

    def fail(self, stage: str, exc: BaseException) -> None:
        self.finish("", "error", f"{stage} failed: {failure_text(exc)}")


def _detached(exc: BaseException) -> BaseException:
    """`exc` without its traceback and chained exceptions: what its frames held (a batch's tensors,
    a parsed response) is freed while the request's error is kept for the end of the set."""
    exc.__traceback__ = exc.__cause__ = exc.__context__ = None
    return exc


def failure_text(exc: BaseException) -> str:
    """An exception as an example's failure reason: "Type: message", on one line, cut at 500 characters
    (a message can quote a whole tensor or prompt)."""
    return f"{type(exc).__name__}: {printable(' '.join(str(exc).split())[:500])}"


def run_rows(backend: Backend, rows: list[EvalRow], prompting: Prompting, executor: ToolExecutor | None,
             set_index: int, ranks=ONE_PROCESS) -> tuple[list[ModelOutput], float]:
    """Every row's output, and the wall time of the backend's answer calls (under `ranks`, the
    ranks of a sharded model, the slowest rank's: they generate side by side).

    Sharded (`glmtune.distributed.lockstep`): the batches of a round are the one process's, each
    answered by one rank (batch b by rank b mod world, tool calls included), the others taking
    an idle share of its collectives; the round's requests are then shared, so every rank forms
    the next round's batches from all of them, as one process does."""
    d = prompting.decoding
    requests = [_Request(row, list(row.prompt), keeps_traceback=index == 0) for index, row in enumerate(rows)]
    pending = list(range(len(requests)))
    generate_s = 0.0
    size = backend.batch_size(d)
    for round_index in range(d.max_tool_rounds + 1):
        batches = [pending[start:start + size] for start in range(0, len(pending), size)]
        handled = {}
        for batch_index in ranks.mine(len(batches)):
            if batch_index is None:
                backend.idle(prompting)
                continue
            indices = batches[batch_index]
            seed = d.seed + 1_000_003 * set_index + 10_007 * round_index + batch_index
            generate_s += _answer_batch(backend, [requests[i] for i in indices], prompting, seed)
            for i in indices:
                if requests[i].output is None:
                    _turn(requests[i], round_index < d.max_tool_rounds, executor, prompting)
                handled[i] = requests[i]
        for i, request in ranks.share(handled).items():
            requests[i] = request
        pending = [i for i in pending if requests[i].output is None]
        if not pending:
            break
    assert all(r.output is not None for r in requests)
    failed = [r.generation_error for r in requests if r.generation_error is not None]
    if failed and len(failed) == len(requests):
        raise failed[0]  # not one request's trouble: the model (or generation) is broken
    return [r.output for r in requests], max(ranks.share({ranks.rank: generate_s}).values())


def _answer_batch(backend: Backend, batch: list[_Request], prompting: Prompting, seed: int) -> float:
    """One generation round of `batch`: each request gets its turn (`_Request.turn`) or fails;
    the seconds the backend spent."""
    results, seconds = backend.answer([(r.messages, r.row.tools) for r in batch], prompting, seed)
    for request, result in zip(batch, results):
        if isinstance(result, Failed):
            if result.stage == "generation":
                request.generation_error = result.error if request.keeps_traceback else _detached(result.error)
            request.fail(result.stage, result.error)
            continue
        request.latency_s += result.latency_s
        request.tokens += result.tokens
        request.pieces.append(result.text)
        request.turn = result
    return seconds


def _turn(request: _Request, may_call: bool, executor: ToolExecutor | None, prompting: Prompting) -> bool:
    """`_continue` on the request's generated text; a failure there fails this request only."""
    try:
        return _continue(request, request.turn, may_call, executor, prompting)
    except Exception as exc:  # e.g. a row's tool schema the validator cannot use
        request.fail("handling the output", exc)
        return False


def _continue(request: _Request, turn: Turn, may_call: bool, executor: ToolExecutor | None,
              prompting: Prompting | None = None) -> bool:
    """Handle one generated turn; True when the request goes on to another round."""
    if turn.calls is None:  # the template's own call format (GLM's also without a `prompting`, as in tests)
        parse = parser_for(chat_format(prompting.template).turns) if prompting is not None else parse_tool_calls
        content, parsed = parse(turn.text, request.row.tools)
    else:  # the engine parsed the calls (chat API): its text is the visible content
        content, parsed = turn.text, turn.calls
    if not parsed:
        request.finish(turn.text, "length" if turn.finish == "length" else "answer")
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
    request.pieces.append(_tool_turns(prompting, request.messages, request.row.tools, executed))
    return True
