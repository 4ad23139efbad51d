"""The tool-call loop split over two gloo ranks (`answering.run_rows` under a `Lockstep`): the same
outputs as one process, through tool rounds, with each request's tool calls executed once.

The backend answers from the prompt (a call of the real `lookup_order` for the rows that need
one, in GLM-5 markup, then the answer after the tool turn), so the rounds are real: round 2's
batches are formed from the requests both ranks continued. The tool function counts its calls in
a file per process, so a call executed on both ranks (or twice) is seen. Seven rows in batches of
2: four batches in round 1, rank 1 idles in none, then two continuing requests in one batch in
round 2 (rank 1 idles)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from glmtune.data.chat_template import bundled_template
from glmtune.data.synthetic import generate_rows, lookup_order
from glmtune.data.tokenizer import load_tokenizer
from glmtune.distributed.lockstep import ONE_PROCESS, Lockstep
from glmtune.eval.answering import Prompting, run_rows
from glmtune.eval.backends import Turn
from glmtune.eval.scorers.base import EvalRow
from glmtune.eval.suite import DecodingConfig
from glmtune.eval.tools import ToolExecutor
from tests.distributed.gloo_helpers import run_gloo

COUNT_DIR = "GLMTUNE_TEST_TOOL_COUNTS"
REPO = Path(__file__).resolve().parents[2]


def counted_lookup_order(order_id: str) -> dict:
    """`lookup_order`, each call recorded in a file of this process (the executor's worker)."""
    with open(Path(os.environ[COUNT_DIR]) / f"calls-{os.getpid()}.txt", "a") as f:
        f.write(order_id + "\n")
    return lookup_order(order_id)


class _Scripted:
    """Answers each request from its messages: a tool call first where the row needs one."""

    def __init__(self) -> None:
        self.idles = 0

    def batch_size(self, decoding) -> int:
        return decoding.batch_size

    def answer(self, requests, prompting, seed):
        turns = []
        for messages, tools in requests:
            if tools and messages[-1]["role"] == "user":
                order = json.loads(messages[-1]["content"])["order"]
                text = (f"<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>{order}</arg_value>"
                        "</tool_call>")
            else:
                text = f"answer after {messages[-1]['role']} (seed {seed})"
            turns.append(Turn(text, "stop_token", 3, 0.01))
        return turns, 0.01

    def idle(self, prompting) -> None:
        self.idles += 1


def _rows() -> list[EvalRow]:
    tool = [r for r in generate_rows(200, seed=5) if r["category"] == "tool_call"][0]["tools"]
    rows = []
    for i in range(7):
        needs_call = i in (1, 4)
        user = json.dumps({"order": f"ORD-{10000 + i}", "row": i})
        rows.append(EvalRow("t", f"r{i}", "x", f"f:{i}", {}, [{"role": "user", "content": user}],
                            tool if needs_call else None, None, [], []))
    return rows


def _tool_env(count_dir: Path) -> dict[str, str]:
    """Where the counting tool writes; the executor's worker imports it from this repository."""
    return {COUNT_DIR: str(count_dir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _answers(ranks, count_dir: Path) -> tuple[list, int]:
    prompting = Prompting(load_tokenizer(), bundled_template(), False,
                          DecodingConfig(max_new_tokens=4, batch_size=2, max_tool_rounds=2))
    backend = _Scripted()
    functions = {"lookup_order": "tests.eval.test_sharded_rounds:counted_lookup_order"}
    with ToolExecutor(functions, 30, count_dir) as executor:
        outs, _ = run_rows(backend, _rows(), prompting, executor, 0, ranks)
    return [(o.text, o.transcript, o.finish, [(c.name, c.arguments, c.ok, c.result) for c in o.tool_calls])
            for o in outs], backend.idles


def _rank(rank: int, world: int, tmp: str) -> None:
    os.environ.update(_tool_env(Path(tmp) / f"counts-{rank}"))  # this rank's own process
    outs, idles = _answers(Lockstep(torch.device("cpu")), Path(tmp) / f"counts-{rank}")
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps({"outs": outs, "idles": idles}))


def test_two_ranks_answer_tool_rounds_as_one_process_and_run_each_call_once(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    for name, value in _tool_env(tmp_path / "one").items():
        monkeypatch.setenv(name, value)
    expected, _ = _answers(ONE_PROCESS, tmp_path / "one")
    assert sum(1 for o in expected if o[3]) == 2 and all(o[3][0][2] for o in expected if o[3])  # two calls, both ran
    for rank in (0, 1):
        (tmp_path / f"counts-{rank}").mkdir()
    run_gloo(_rank, 2, tmp_path, str(tmp_path), timeout_s=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [json.loads(json.dumps(expected))] * 2 == [r["outs"] for r in results]
    calls = sorted(line for r in (0, 1) for f in (tmp_path / f"counts-{r}").glob("calls-*.txt")
                   for line in f.read_text().split())
    assert calls == ["ORD-10001", "ORD-10004"]  # each request's call executed once, on one rank
    assert [r["idles"] for r in results] == [0, 1]  # round 2's one batch: rank 1 took its idle step
