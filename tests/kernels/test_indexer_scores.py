"""The fused indexer-score kernel against the pure-torch reference (`Indexer.combine`).

On CPU the Triton kernel runs in Triton's interpreter, which must be switched on before
triton is imported, so the checks run in a child process with TRITON_INTERPRET=1.
"""

import sys

import pytest
import torch
from triton_interpreter import ROOT, main, run_checks_in_interpreter

pytest.importorskip("triton")


def check_scores_match_reference():
    from glmtune.kernels.indexer_scores import indexer_scores
    from glmtune.models.glm5.indexer import Indexer

    torch.manual_seed(0)
    batch, seq_q, seq_k, heads, dim = 2, 37, 53, 5, 24  # nothing a multiple of the tile
    q = torch.randn(batch, seq_q, heads, dim).bfloat16()
    k = torch.randn(batch, seq_k, dim).bfloat16()
    w = torch.randn(batch, seq_q, heads)
    reference = Indexer.combine(q, k, w, 0.17)
    torch.testing.assert_close(indexer_scores(q, k, w, 0.17), reference, rtol=1e-5, atol=1e-5)
    # causal: tiles wholly in the future are skipped; every key <= query + offset is scored
    offset = 9
    got = indexer_scores(q, k, w, 0.17, causal_offset=offset)
    visible = torch.arange(seq_k)[None, :] <= torch.arange(seq_q)[:, None] + offset
    torch.testing.assert_close(got * visible, reference * visible, rtol=1e-5, atol=1e-5)
    q_view = torch.randn(batch, seq_q, heads * 2, dim).bfloat16()[:, :, ::2]  # strided heads
    torch.testing.assert_close(indexer_scores(q_view, k, w, 0.5), Indexer.combine(q_view, k, w, 0.5),
                               rtol=1e-5, atol=1e-5)


def check_fused_backend_selects_what_the_reference_selects():
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from test_indexer import _explicit, _inputs, _masked_scores, assert_same_up_to_ties

    import glmtune.models.glm5.indexer as indexer_module
    from glmtune.models.glm5.args import get_preset

    args = get_preset("tiny").replace(index_topk=16)
    for positions, plain in ((torch.arange(70).repeat(2, 1), True),
                             (torch.cat([torch.arange(n) for n in (40, 30, 26)]).repeat(2, 1), False)):
        indexer, *inputs = _inputs(args, positions, None)
        reference = _explicit(indexer, *inputs)
        indexer.backend = "fused"
        indexer_module._CHUNK_SCORE_BYTES = 4 * 2 * positions.shape[1] * 11  # 11 queries per chunk
        got, all_selected = indexer(*inputs, plain_causal=plain)
        assert not all_selected
        assert_same_up_to_ties(got, reference, _masked_scores(indexer, *inputs), 16, atol=1e-5)


def test_kernel_in_triton_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_scores_match_reference",
                                                   "check_fused_backend_selects_what_the_reference_selects"]


if __name__ == "__main__":
    main(check_scores_match_reference, check_fused_backend_selects_what_the_reference_selects)
