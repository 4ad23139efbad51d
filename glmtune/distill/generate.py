"""`glmtune distill generate`: a teacher's answers to a dataset's prompts, as a dataset a student
trains on (docs/distill.md).

For each prompt (`prompts.read_prompts`) not already done in --out (`output.Output`), the teacher
(`teachers`) answers up to `samples` times; the first answer that is complete (not cut at
max_new_tokens), parses (its tool calls, in the template's format), passes the data contract as
the assistant turn and, with --keep-if, the suite's format scorers (`verify`) is kept: its row goes
to rows.jsonl, its top-K log-probabilities to the sidecar. A prompt whose every sample is rejected
is recorded in rejected.jsonl (a rerun does not ask again). A prompt whose request fails (after
the client's retries) or whose log-probabilities are malformed fails, counted by reason: it is not
recorded, so the rerun asks again. Nothing that is done is lost when the teacher fails midway or
the command is killed; the manifest counts done, rejected and failed rows.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from glmtune.data.contract import check_conversation, normalize_row
from glmtune.data.sources import Origin
from glmtune.distill.align import align, rendered_targets
from glmtune.distill.output import Output
from glmtune.distill.prompts import Prompt
from glmtune.distill.teacher_logprobs import Malformed
from glmtune.distill.teachers import Answer, EndpointTeacher, LocalTeacher, parse_calls
from glmtune.distill.verify import Verifier
from glmtune.eval.endpoint_client import RequestFailed
from glmtune.io.text_limits import clipped

NO_LOGPROBS = ("the teacher returned no log-probabilities (transformers serve gives none): its rows are written "
               "for sequence-level distillation only, without top-K records")
_KEPT_MESSAGES = 10


@dataclass
class Outcome:
    prompt: Prompt
    row: dict[str, Any] | None = None  # kept
    answer: Answer | None = None
    rejected: list[str] = field(default_factory=list)  # every sample's reason, when none was kept
    failed: str | None = None  # the counted reason
    message: str | None = None  # the failure in one line


@dataclass
class Counts:
    failures: Counter = field(default_factory=Counter)
    rejections: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    written: int = 0
    without_topk: int = 0
    positions: int = 0  # sidecar positions written this run (the rendered turns' tokens)
    matched: int = 0  # of them, those holding the teacher's top-K (align)
    no_logprobs_said: bool = False


@dataclass(frozen=True)
class Policy:
    """What every prompt's samples share: how many, their seed, what keeps an answer."""

    samples: int
    seed: int
    verifier: Verifier | None
    keep_truncated: bool


def sample_seed(seed: int, row_id: str, sample: int) -> int:
    """The seed of one sample of one row: the same on every rerun, whatever else is pending."""
    return (seed * 1_000_003 + zlib.crc32(row_id.encode()) * 7919 + sample) % (2**31 - 1)


def _row(prompt: Prompt, answer: Answer, template: str, api: str) -> dict[str, Any]:
    """The kept row: the prompt and the answer as its assistant turn; Malformed when it breaks the contract."""
    if answer.calls is not None:  # the chat API parsed them
        turn = {"role": "assistant", "content": answer.text, "tool_calls": answer.calls}
    else:
        content, calls = parse_calls(answer.text, template, prompt.tools) if api != "chat" else (answer.text, [])
        turn = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
    row = {"id": prompt.row_id, **prompt.kept, "messages": [*prompt.messages, turn]}
    if prompt.tools:
        row["tools"] = prompt.tools
    found = check_conversation(row, Origin("answer", 1))
    if found:
        raise Malformed("answer breaks the data contract", f"{found[0].field}: {found[0].reason}")
    return normalize_row(row)


def judge(prompt: Prompt, answer: Answer, teacher: EndpointTeacher | LocalTeacher, api: str,
          policy: Policy) -> tuple[dict[str, Any] | None, str | None]:
    """(the row, None) for a kept answer (its top-K laid on the rendered turn: `align`), (None, why)
    for a rejected one; Malformed for a failed one."""
    if answer.finish == "length" and not policy.keep_truncated:
        return None, "cut at max_new_tokens"
    try:
        row = _row(prompt, answer, teacher.template, api)
    except Malformed as exc:
        if exc.reason == "bad tool call":
            return None, str(exc)
        raise
    if policy.verifier is not None:
        failures = policy.verifier.failures(row["messages"][-1].get("content") or "", prompt.messages, prompt.tools)
        if failures:
            return None, "keep-if: " + "; ".join(failures[:2])
    if answer.topk is not None:
        try:
            rendered = rendered_targets(row, teacher.tokenizer, teacher.template, teacher.enable_thinking)
        except ValueError as exc:  # the template cannot tell the turn's tokens: not a row to train on
            raise Malformed("answer does not render", str(exc)) from None
        answer.topk = align(answer.topk, rendered)
    return row, None


def answer_endpoint(teacher: EndpointTeacher, prompt: Prompt, policy: Policy) -> Outcome:
    """One prompt's samples against a served teacher, up to the first kept answer."""
    rejected = []
    for sample in range(policy.samples):
        try:
            answer = teacher.answer(prompt.messages, prompt.tools, sample_seed(policy.seed, prompt.row_id, sample))
            row, why = judge(prompt, answer, teacher, teacher.source.api, policy)
        except RequestFailed as exc:
            return Outcome(prompt, failed=f"request failed ({exc.kind})", message=str(exc))
        except Malformed as exc:
            return Outcome(prompt, failed=exc.reason, message=str(exc))
        if row is not None:
            return Outcome(prompt, row, answer)
        rejected.append(why)
    return Outcome(prompt, rejected=rejected)


def answer_local(teacher: LocalTeacher, prompts: list[Prompt], policy: Policy) -> list[Outcome]:
    """A batch of prompts' samples in process (sample s of the batch seeded by its first row)."""
    outcomes = {p.row_id: Outcome(p) for p in prompts}
    pending = list(prompts)
    for sample in range(policy.samples):
        if not pending:
            break
        answers = teacher.answer_batch([(p.messages, p.tools) for p in pending],
                                       sample_seed(policy.seed, pending[0].row_id, sample))
        still = []
        for prompt, answer in zip(pending, answers):
            outcome = outcomes[prompt.row_id]
            try:
                row, why = judge(prompt, answer, teacher, "completions", policy)
            except Malformed as exc:
                outcome.failed, outcome.message = exc.reason, f"{prompt.row_id}: {exc}"
                continue
            if row is not None:
                outcome.row, outcome.answer = row, answer
            else:
                outcome.rejected.append(why)
                still.append(prompt)
        pending = still
    return list(outcomes.values())


def record(output: Output, outcome: Outcome, counts: Counts, log: Callable[[str], None]) -> None:
    """Write one prompt's outcome (main thread only: one writer)."""
    if outcome.failed is not None:
        counts.failures[outcome.failed] += 1
        if len(counts.messages) < _KEPT_MESSAGES:
            counts.messages.append(f"{outcome.prompt.row_id}: {clipped(outcome.message, 300)}")
        return
    if outcome.row is None:
        for why in outcome.rejected:
            counts.rejections[why.split(":")[0]] += 1
        output.add_rejected(outcome.prompt.row_id, outcome.rejected)
        return
    answer = outcome.answer
    if answer.no_logprobs:
        counts.without_topk += 1
        if not counts.no_logprobs_said:
            counts.no_logprobs_said = True
            log(NO_LOGPROBS)
    output.add_row(outcome.row, answer.topk)
    counts.written += 1
    if answer.topk is not None:
        counts.positions += len(answer.topk.generated)
        counts.matched += int((answer.topk.generated >= 0).sum())


def run_endpoint(teacher: EndpointTeacher, pending: list[Prompt], output: Output, counts: Counts, policy: Policy,
                 concurrency: int, log: Callable[[str], None]) -> None:
    with ThreadPoolExecutor(concurrency, thread_name_prefix="glmtune-distill") as pool:
        futures = [pool.submit(answer_endpoint, teacher, p, policy) for p in pending]
        try:
            for number, future in enumerate(as_completed(futures), 1):
                record(output, future.result(), counts, log)
                _progress(number, len(pending), log)
        except BaseException:
            for future in futures:
                future.cancel()  # a Ctrl-C: the requests in flight finish, no new one starts
            raise


def run_local(teacher: LocalTeacher, pending: list[Prompt], output: Output, counts: Counts, policy: Policy,
              batch_size: int, log: Callable[[str], None]) -> None:
    for start in range(0, len(pending), batch_size):
        for outcome in answer_local(teacher, pending[start:start + batch_size], policy):
            record(output, outcome, counts, log)
        _progress(min(start + batch_size, len(pending)), len(pending), log)


def _progress(number: int, total: int, log: Callable[[str], None]) -> None:
    if number == total or number % 100 == 0:
        log(f"  {number}/{total} prompts answered")


def summary(output: Output, counts: Counts, prompts: int, began: float, faults: dict | None) -> dict[str, Any]:
    failed = sum(counts.failures.values())
    without = len(output.done - set(output.topk.row_ids)) if output.topk is not None else None
    return {"prompts": prompts, "done": len(output.done), "rejected": len(output.rejected), "failed": failed,
            "written_this_run": counts.written, "rows_without_topk": without,
            "topk_positions_this_run": counts.positions, "topk_positions_matched_this_run": counts.matched,
            **({"note": NO_LOGPROBS} if counts.no_logprobs_said else {}),
            "failures": dict(sorted(counts.failures.items())), "rejections": dict(sorted(counts.rejections.items())),
            "failed_examples": counts.messages, "seconds": round(time.monotonic() - began, 3),
            **({"endpoint": faults} if faults is not None else {})}
