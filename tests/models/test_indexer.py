"""The DSA indexer's shortcut (skip scoring when no query has more than k allowed keys)
is exact: it equals running the scores and top-k."""

import torch

from glmtune.models.common.document_masks import allowed_mask
from glmtune.models.common.rope import RotaryEmbedding
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.indexer import Indexer


def _inputs(args, positions, documents):
    torch.manual_seed(0)
    indexer = Indexer(args)
    indexer.reset_parameters(0.5)
    batch, seq = positions.shape
    x = torch.randn(batch, seq, args.hidden_size)
    q_resid = torch.randn(batch, seq, args.q_lora_rank)
    cos, sin = RotaryEmbedding(args.rope_parameters, args.qk_rope_head_dim, 4096)(positions, torch.float32)
    return indexer, x, q_resid, cos, sin, allowed_mask(batch, seq, x.device, positions, documents)


def _explicit(indexer, x, q_resid, cos, sin, allowed):
    scores = indexer.scores(x, q_resid, cos, sin).masked_fill(~allowed, torch.finfo(torch.float32).min)
    top = scores.topk(indexer.index_topk, dim=-1).indices
    return allowed & torch.zeros_like(allowed).scatter(-1, top, True)


def assert_same_up_to_ties(got_BST, reference_BST, scores_BST, k, atol=0.0):
    """Masks equal except among keys whose score ties the query's k-th best (within atol).

    Top-k between equal scores (e.g. ReLU zeroes every head) is arbitrary, and may
    change with the key range a backend scores; a fused kernel's fp32 sums may also
    reorder scores closer than their rounding.
    """
    assert torch.equal(got_BST.sum(-1), reference_BST.sum(-1))
    differ = got_BST != reference_BST
    if not differ.any():
        return
    kth = scores_BST.masked_fill(~reference_BST, float("inf")).amin(-1, keepdim=True)  # k-th best kept
    near_kth = (scores_BST - kth).abs() <= atol
    assert bool(near_kth[differ].all()), "selections differ on keys that are not tied with the k-th score"


def _masked_scores(indexer, x, q_resid, cos, sin, allowed):
    return indexer.scores(x, q_resid, cos, sin).masked_fill(~allowed, torch.finfo(torch.float32).min)


def test_short_documents_skip_is_exact():
    args = get_preset("tiny").replace(index_topk=16)
    lengths = [10, 16, 7, 15]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    indexer, *inputs = _inputs(args, positions, documents)
    allowed = inputs[-1]
    assert allowed.sum(-1).max().item() <= 16  # what the model checks before skipping
    mask, all_selected = indexer(*inputs, sparse_needed=False)
    assert all_selected and torch.equal(mask, _explicit(indexer, *inputs))
    assert torch.equal(indexer(*inputs, sparse_needed=True)[0], mask)  # scoring gives the same mask


def test_long_document_is_sparse():
    args = get_preset("tiny").replace(index_topk=16)
    positions = torch.arange(48).unsqueeze(0)
    indexer, *inputs = _inputs(args, positions, None)
    mask, all_selected = indexer(*inputs)
    assert not all_selected and torch.equal(mask, _explicit(indexer, *inputs))
    assert mask.sum(-1).max().item() == 16  # later queries see exactly k keys
    assert torch.equal(mask.sum(-1)[0, :16], torch.arange(1, 17))  # early queries see all their past


def test_chunked_backend_selects_what_the_reference_selects(monkeypatch):
    import glmtune.models.glm5.indexer as indexer_module

    args = get_preset("tiny").replace(index_topk=16)
    lengths = [40, 30, 26]
    positions = torch.cat([torch.arange(n) for n in lengths]).repeat(2, 1)
    indexer, *inputs = _inputs(args, positions, None)
    reference = _explicit(indexer, *inputs)
    indexer.backend = "chunked"
    monkeypatch.setattr(indexer_module, "_CHUNK_SCORE_BYTES", 4 * 2 * 4 * 96 * 7)  # 7 queries per chunk
    got = indexer(*inputs)[0]
    assert_same_up_to_ties(got, reference, _masked_scores(indexer, *inputs), 16)
    assert reference.sum(-1).max().item() == 16


def test_one_document_rows_skip_the_first_k_queries(monkeypatch):
    """Single-document rows: queries before k keep their whole past without being scored."""
    import glmtune.models.glm5.indexer as indexer_module

    args = get_preset("tiny").replace(index_topk=16, index_n_heads=16)  # 16 heads: no all-zero ties
    positions = torch.arange(61).repeat(2, 1)
    indexer, *inputs = _inputs(args, positions, None)
    reference = _explicit(indexer, *inputs)
    calls = []
    original = indexer_module.Indexer.combine
    monkeypatch.setattr(indexer_module.Indexer, "combine",
                        staticmethod(lambda q, *a: calls.append(q.shape[1]) or original(q, *a)))
    monkeypatch.setattr(indexer_module, "_CHUNK_SCORE_BYTES", 4 * 2 * 16 * 61 * 20)  # 20 queries per chunk
    got, all_selected = indexer(*inputs, plain_causal=True)
    assert not all_selected and torch.equal(got, reference)
    assert calls == [20, 20, 5]  # queries 16..60 only
