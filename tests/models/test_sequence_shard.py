"""`SequenceShard`: which queries a context-parallel rank owns, and the model's one-process
behaviour under a one-rank shard (the whole sharded code path, with the identity gather)."""

import pytest
import torch

from glmtune.models.common.document_masks import allowed_mask
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.sequence_shard import SequenceShard, causal_pairs, pieces_of
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.indexer import dsa_topk_mask


def _shards(size: int, balance: str) -> list[SequenceShard]:
    return [SequenceShard(rank, size, balance, gather=lambda x: x) for rank in range(size)]


@pytest.mark.parametrize("balance", ["head_tail", "contiguous"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_ranks_cover_every_token_once_in_row_order(size, balance):
    seq_len = 16 * size
    indices = [shard.query_index(seq_len) for shard in _shards(size, balance)]
    assert all(len(index) == seq_len // size for index in indices)
    assert torch.equal(torch.cat(indices).sort().values, torch.arange(seq_len))
    assert all(torch.equal(index, index.sort().values) for index in indices)  # pieces in row order


def test_pieces_of_each_balance():
    assert pieces_of(1, 4, "contiguous", 32) == [(8, 8)]
    assert pieces_of(0, 4, "head_tail", 32) == [(0, 4), (28, 4)]
    assert pieces_of(1, 4, "head_tail", 32) == [(4, 4), (24, 4)]
    assert pieces_of(1, 3, "head_tail", 30) == [(5, 5), (20, 5)]
    assert pieces_of(2, 3, "head_tail", 30) == [(10, 10)]  # the last rank: chunks cp-1 and cp touch, one piece
    assert pieces_of(0, 1, "head_tail", 30) == [(0, 30)]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_head_tail_gives_every_rank_the_same_causal_work(size):
    """Exactly equal (query, key) pairs of a causal row per rank; contiguous slices grow with
    the rank: the last does about 2·cp−1 times the work of the first."""
    seq_len = 64 * size
    head_tail = [causal_pairs(shard.pieces(seq_len)) for shard in _shards(size, "head_tail")]
    contiguous = [causal_pairs(shard.pieces(seq_len)) for shard in _shards(size, "contiguous")]
    assert len(set(head_tail)) == 1
    assert sum(head_tail) == sum(contiguous) == seq_len * (seq_len + 1) // 2
    length = seq_len // size
    assert contiguous[0] == length * (length + 1) // 2
    assert contiguous[-1] - contiguous[0] == (size - 1) * length * length


def test_local_slices_dim_1_of_any_per_token_tensor():
    shard = SequenceShard(0, 2, "head_tail", gather=lambda x: x)
    ids = torch.arange(2 * 8 * 3).view(2, 8, 3)
    assert torch.equal(shard.local(ids), ids[:, [0, 1, 6, 7]])
    assert shard.local(torch.arange(8).unsqueeze(0)).shape == (1, 4)  # shared positions stay [1, S]
    assert shard.key_end(8) == 8 and SequenceShard(0, 2, "contiguous", gather=lambda x: x).key_end(8) == 4


def test_user_errors_name_the_key():
    with pytest.raises(ValueError, match="parallel.cp_balance='ring'"):
        SequenceShard(0, 2, "ring", gather=lambda x: x)
    with pytest.raises(ValueError, match="data.packed_sequence_size.*2 x parallel.cp=4"):
        SequenceShard(0, 2, "head_tail", gather=lambda x: x).pieces(510)
    with pytest.raises(ValueError, match="data.packed_sequence_size.*parallel.cp=4 equal slices"):
        SequenceShard(0, 4, "contiguous", gather=lambda x: x).pieces(510)


def test_allowed_mask_of_local_queries_is_those_rows_of_the_full_mask():
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(12)]), torch.arange(32)])
    full = allowed_mask(2, 32, torch.device("cpu"), positions)
    for shard in _shards(4, "head_tail"):
        index = shard.query_index(32)
        assert torch.equal(allowed_mask(2, 32, torch.device("cpu"), positions, query_index_S=index), full[:, index])
        assert torch.equal(allowed_mask(2, 32, torch.device("cpu"), query_index_S=index),
                           allowed_mask(2, 32, torch.device("cpu"))[:, index])


@pytest.mark.parametrize("first_query", [0, 24])
def test_topk_of_local_queries_is_the_one_process_selection(first_query):
    """`dsa_topk_mask` with `query_pieces` over all keys selects what one process selects for
    those queries, ties included: the scores are built with many exact zeros (ReLU of
    negative heads), so the k-th score is a tie that a different key range breaks differently.
    A small chunk (8 queries) makes the local pieces cut the one-process chunks."""
    import glmtune.models.glm5.indexer as indexer_module

    generator = torch.Generator().manual_seed(0)
    batch, seq_len, heads, dim, topk = 2, 96, 2, 8, 24
    q = torch.randn(batch, seq_len, heads, dim, generator=generator)
    k = torch.randn(batch, seq_len, dim, generator=generator)
    w = torch.rand(batch, seq_len, heads, generator=generator)
    positions = torch.stack([torch.cat([torch.arange(60), torch.arange(36)]), torch.arange(seq_len)])
    allowed = allowed_mask(batch, seq_len, torch.device("cpu"), positions)
    chunk_bytes = indexer_module._CHUNK_SCORE_BYTES
    indexer_module._CHUNK_SCORE_BYTES = 4 * batch * heads * seq_len * 8
    try:
        reference = dsa_topk_mask(q, k, w, allowed, 0.3, topk, first_query, False)
        assert (reference != allowed).any()
        for balance in ("head_tail", "contiguous"):
            for shard in _shards(4, balance):
                index = shard.query_index(seq_len)
                pieces = [n for piece in shard.pieces(seq_len) for n in piece]
                got = dsa_topk_mask(q[:, index], k, w[:, index], allowed[:, index], 0.3, topk, first_query, False,
                                    pieces)
                assert torch.equal(got, reference[:, index]), (balance, shard.rank)
    finally:
        indexer_module._CHUNK_SCORE_BYTES = chunk_bytes


@pytest.mark.parametrize("backend", ["sdpa", "gemm", "eager"])
@pytest.mark.parametrize("packed", [False, True])
def test_one_rank_shard_is_bit_identical_to_no_shard(backend, packed):
    """A shard of one rank runs the sharded code (pieces, the gather, the indexer's pieces,
    local slicing of ids and targets) and must not change a bit of the loss or gradients."""
    args = get_preset("tiny").replace(index_topk=48)
    x = torch.randint(0, 4000, (2, 96), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(x, -1, 1)
    positions = torch.cat([torch.arange(70), torch.arange(26)]).unsqueeze(0) if packed else None
    results = []
    for sharded in (False, True):
        model = build_model(args, attention_backend=backend, seed=0)
        if sharded:
            model.model.sequence_shard = SequenceShard(0, 1)
        out = model(x, MicroBatch(x, positions, targets=targets))
        out.loss_sum.backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    assert all(torch.equal(results[0][1][name], results[1][1][name]) for name in results[0][1])
