"""`longest_document` (computed on the host) agrees with the allowed mask the model builds."""

import torch

from glmtune.models.common.document_masks import allowed_mask, documents_from_positions, longest_document
from glmtune.models.common.microbatch import MicroBatch


def _most_allowed_keys(position_ids=None, document_ids=None, batch=2, seq=24):
    return int(allowed_mask(batch, seq, torch.device("cpu"), position_ids, document_ids).sum(-1).max())


def test_longest_document_is_the_most_keys_any_query_may_attend():
    g = torch.Generator().manual_seed(0)
    seq = 24
    for _ in range(20):
        rows = []
        for _ in range(2):
            count = int(torch.randint(0, 4, (1,), generator=g))
            cuts = (torch.randperm(seq - 1, generator=g)[:count] + 1).sort().values
            bounds = [0, *cuts.tolist(), seq]
            rows.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
        positions = torch.stack(rows)
        assert longest_document(seq, positions) == _most_allowed_keys(positions)
        documents = documents_from_positions(positions)
        assert longest_document(seq, document_ids_BS=documents) == _most_allowed_keys(document_ids=documents)


def test_non_contiguous_document_ids_and_plain_rows():
    documents = torch.tensor([[0, 0, 1, 0, 1, 1, 1, 2]])  # document 1 has 4 tokens, not contiguous
    assert longest_document(8, document_ids_BS=documents) == 4 == _most_allowed_keys(document_ids=documents,
                                                                                        batch=1, seq=8)
    assert longest_document(8) == 8  # no ids: one causal document per row
    assert longest_document(8, torch.arange(8)[None]) == 8


def test_one_single_document_row_does_not_make_a_packed_row_plain_causal():
    # A truncated conversation fills its row; a packed row beside it must keep its document
    # boundaries (the plain causal path is for batches whose every row is one document).
    from glmtune.models.glm5 import build_model, get_preset
    from glmtune.models.common.document_masks import single_document_rows

    seq = 320  # above the tiny preset's top-k (256): the sparse path and its causal prefix both run
    positions = torch.stack([torch.arange(seq), torch.cat([torch.arange(100), torch.arange(seq - 100)])])
    assert longest_document(seq, positions) == seq and not single_document_rows(seq, positions)
    assert single_document_rows(seq, positions[:1])
    model = build_model(get_preset("tiny"), torch.float32, seed=0).eval()
    ids = torch.randint(0, 1000, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both = model(ids, MicroBatch(ids, positions)).logits
        alone = model(ids[1:], MicroBatch(ids[1:], positions[1:])).logits
    torch.testing.assert_close(both[1], alone[0], rtol=1e-5, atol=1e-5)
