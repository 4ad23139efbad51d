"""`glmtune distill generate` against a real `transformers serve` (started as tests/eval/test_endpoint.py
starts it) serving the tiny teacher: transformers serve refuses `return_tokens_as_token_ids` (422:
asked again without, said in one line) and returns no log-probabilities, so --top-logprobs K gives
sequence-level rows, said in one line; its greedy answers are the in-process teacher's."""

from __future__ import annotations

import json

from glmtune.cli import main
from tests.distill.test_generate_local import data, teacher  # noqa: F401 - fixtures shared with the in-process tests
from tests.eval.test_endpoint import _serve, _stop


def _rows(out) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}


def test_transformers_serve_gives_sequence_level_rows_equal_to_in_process(teacher, data, tmp_path,  # noqa: F811
                                                                          capsys):
    _, hf_dir = teacher
    common = [*map(str, data), "--max-new-tokens", "8", "--keep-truncated"]
    assert main(["distill", "generate", *common, "--out", str(tmp_path / "local"), "--teacher", str(hf_dir)]) == 0
    process, url = _serve(hf_dir, tmp_path / "serve.log")
    try:
        capsys.readouterr()
        assert main(["distill", "generate", *common, "--out", str(tmp_path / "served"), "--teacher", url,
                     "--tokenizer", str(hf_dir), "--top-logprobs", "4", "--concurrency", "2"]) == 0
    finally:
        _stop(process)
    printed = capsys.readouterr().out
    assert printed.count("returned no log-probabilities") == 1
    assert printed.count("refused return_tokens_as_token_ids (http 422)") == 1  # it refuses unknown fields
    served, local = _rows(tmp_path / "served"), _rows(tmp_path / "local")
    assert sorted(served) == sorted(local) and len(served) == 5
    same = sum(served[i]["messages"] == local[i]["messages"] for i in served)
    assert same == len(served), f"{same} of {len(served)} answers equal the in-process teacher's"
    manifest = json.loads((tmp_path / "served" / "manifest.json").read_text())
    assert manifest["counts"]["rows_without_topk"] == 5 and manifest["teacher"]["endpoint"] == url
