"""Block-causal attention masks for packed rows.

A packed row holds several documents back to back. A query may attend a key only
when the key is not in its future and both belong to the same document. Documents
are given explicitly (`document_ids`) or found, as transformers does, where
`position_ids` do not step by exactly one.

Legend: B batch, S query length, T key length (S == T in one process; S = T / cp under
context parallelism).
"""

from __future__ import annotations

import torch


def documents_from_positions(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Document index per token: a new document starts wherever positions do not step by one."""
    first = position_ids_BS[:, :1] - 1
    steps = torch.diff(position_ids_BS, prepend=first, dim=-1)
    return (steps != 1).cumsum(-1)


def allowed_mask(
    batch_size: int,
    seq_len: int,
    device: torch.device,
    position_ids_BS: torch.Tensor | None = None,
    document_ids_BS: torch.Tensor | None = None,
    query_index_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bool [B, S, T]: True where query s may attend key t (causal, same document).

    The ids describe the full rows of `seq_len` tokens. `query_index_S` (context
    parallelism) picks the queries by their index in the row: the mask is then
    [B, len(query_index_S), seq_len], never the full [B, T, T].
    """
    if document_ids_BS is None and position_ids_BS is not None:
        document_ids_BS = documents_from_positions(position_ids_BS.expand(batch_size, -1))
    if query_index_S is not None:
        causal_ST = query_index_S[:, None] >= torch.arange(seq_len, device=device)[None, :]
        if document_ids_BS is None:
            return causal_ST.expand(batch_size, -1, -1)
        documents_BS = document_ids_BS.expand(batch_size, -1)
        same_doc_BST = documents_BS[:, query_index_S, None] == documents_BS[:, None, :]
        return same_doc_BST & causal_ST
    causal_ST = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if document_ids_BS is None:
        return causal_ST.expand(batch_size, seq_len, seq_len)
    same_doc_BST = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    return same_doc_BST & causal_ST


def longest_document(
    seq_len: int, position_ids_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None
) -> int:
    """The most keys any query may attend: the longest document of any row (tokens sharing
    an id, contiguous or not). At most the indexer's top-k means no query needs sparse
    selection; below `seq_len` means no row is a single document (`single_document_rows`
    says whether all are).

    Compute it where the ids are on the host (the data loader's batch) and pass it to the
    model's forward: on the GPU it costs a host sync, which stalls the launch queue.
    """
    if document_ids_BS is None and position_ids_BS is not None:
        document_ids_BS = documents_from_positions(position_ids_BS)
    if document_ids_BS is None:
        return seq_len
    return max(_row_longest(document_ids_BS, seq_len))


def single_document_rows(
    seq_len: int, position_ids_BS: torch.Tensor | None = None, document_ids_BS: torch.Tensor | None = None
) -> bool:
    """Whether *every* row is one document, so the plain causal mask is the whole mask.

    Not the same as `longest_document(...) == seq_len`, which holds as soon as one row is a
    single document: a batch can mix such a row (a truncated conversation) with packed ones.
    """
    if document_ids_BS is None and position_ids_BS is not None:
        document_ids_BS = documents_from_positions(position_ids_BS)
    if document_ids_BS is None:
        return True
    return min(_row_longest(document_ids_BS, seq_len)) == seq_len


def _row_longest(document_ids_BS: torch.Tensor, seq_len: int) -> list[int]:
    assert document_ids_BS.shape[-1] == seq_len, (document_ids_BS.shape, seq_len)
    return [int(torch.unique(row, return_counts=True)[1].max()) for row in document_ids_BS.reshape(-1, seq_len)]
