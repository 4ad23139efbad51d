"""Block-causal attention masks for packed rows.

A packed row holds several documents back to back. A query may attend a key only
when the key is not in its future and both belong to the same document. Documents
are given explicitly (`document_ids`) or found, as transformers does, where
`position_ids` do not step by exactly one.

Legend: B batch, S query length, T key length (S == T in training).
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
) -> torch.Tensor:
    """Bool [B, S, T]: True where query s may attend key t (causal, same document)."""
    causal_ST = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if document_ids_BS is None and position_ids_BS is not None:
        document_ids_BS = documents_from_positions(position_ids_BS.expand(batch_size, -1))
    if document_ids_BS is None:
        return causal_ST.expand(batch_size, seq_len, seq_len)
    same_doc_BST = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    return same_doc_BST & causal_ST


def is_single_document(position_ids_BS: torch.Tensor | None, document_ids_BS: torch.Tensor | None) -> bool:
    """True when every row is one document, so the allowed mask is the plain causal one."""
    if document_ids_BS is not None:
        return bool((document_ids_BS == document_ids_BS[:, :1]).all())
    if position_ids_BS is not None:
        return not bool(documents_from_positions(position_ids_BS).any())
    return True
