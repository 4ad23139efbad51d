"""Per-rank work of context parallelism, contiguous vs head_tail slices: counted, not timed.

    python benchmarks/cp_balance.py                      # GLM-5, 32K rows, cp 8
    python benchmarks/cp_balance.py --seq 16384 --cp 4

For a row of T tokens split over cp ranks (`glmtune/models/common/sequence_shard.py`), each
rank's share of:
  (a) sparse attention (query, key) pairs: min(keys the query may see, index_topk) per query;
      for one-document rows and for rows packed from the bundled synthetic support tickets
      (tokenized with the tiny tokenizer, first-fit decreasing into rows of T tokens);
  (b) indexer score pairs: i + 1 per query i of a one-document row (every past key is scored;
      quadratic). The model skips the first index_topk queries of one-document rows (they
      select their whole past); the "as run" column counts that;
  (c) kv_b recompute keys: every rank runs kv_b over the gathered latent up to its last query.
Also the per-layer communication and the gathered buffers per rank, from the model's dims.
No weights are needed: the model is described by its preset.

Legend: T tokens of a row, S = T / cp queries per rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glmtune.models.glm5.args import get_preset  # noqa: E402
from glmtune.models.common.sequence_shard import BALANCES, SequenceShard  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="glm5")
    p.add_argument("--seq", type=int, default=32768, help="tokens per packed row")
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--ticket-rows", type=int, default=4000, help="synthetic tickets to pack (0: skip)")
    return p.parse_args(argv)


def shards(cp: int, balance: str) -> list[SequenceShard]:
    # Counting only: no collective behind the gather.
    return [SequenceShard(rank, cp, balance, gather=lambda x: x) for rank in range(cp)]


def keys_per_query(document_lengths: list[int]) -> torch.Tensor:
    """int64 [T]: how many keys each query of a packed row may attend (causal, same document)."""
    return torch.cat([torch.arange(1, n + 1) for n in document_lengths])


def per_rank(work_T: torch.Tensor, cp: int, balance: str) -> list[int]:
    seq = work_T.shape[0]
    return [int(work_T[shard.query_index(seq)].sum()) for shard in shards(cp, balance)]


def ticket_rows(num_tickets: int, seq: int) -> list[list[int]]:
    """Document lengths of the rows the bundled synthetic tickets pack into (the last,
    partly filled row dropped; the padding is one more document, as the packer makes it)."""
    from glmtune.data.chat_template import tokenize_row
    from glmtune.data.packing import first_fit_decreasing
    from glmtune.data.synthetic import generate_rows
    from glmtune.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    lengths = [len(tokenize_row(row, tokenizer).input_ids) for row in generate_rows(num_tickets, seed=0)]
    rows = [[lengths[i] for i in row] for row in first_fit_decreasing(lengths, seq)]
    full = [row for row in rows if seq - sum(row) < 512]
    return [row + ([seq - sum(row)] if sum(row) < seq else []) for row in full]


def table(title: str, columns: dict[str, list[int]], cp: int) -> list[str]:
    lines = [f"{title}", "| rank | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for rank in range(cp):
        cells = [f"{values[rank] / sum(values):6.1%}" for values in columns.values()]
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    imbalance = [f"{max(values) / (sum(values) / cp):.2f}" for values in columns.values()]
    lines.append("| max / mean | " + " | ".join(imbalance) + " |")
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    model = get_preset(args.preset)
    seq, cp, topk = args.seq, args.cp, model.index_topk
    one_document = keys_per_query([seq])
    sparse = one_document.clamp(max=topk)
    scored_as_run = torch.where(torch.arange(seq) >= topk, one_document, 0)
    columns = {}
    for balance in BALANCES:
        columns[f"attn {balance}"] = per_rank(sparse, cp, balance)
    for balance in BALANCES:
        columns[f"indexer {balance}"] = per_rank(one_document, cp, balance)
    for balance in BALANCES:
        columns[f"indexer as run {balance}"] = per_rank(scored_as_run, cp, balance)
    for balance in BALANCES:
        columns[f"kv_b keys {balance}"] = [shard.key_end(seq) for shard in shards(cp, balance)]
    print(f"{args.preset}: T = {seq}, cp = {cp}, index_topk = {topk}; share of each quantity per rank\n")
    print("\n".join(table("One-document rows:", columns, cp)))

    if args.ticket_rows:
        rows = ticket_rows(args.ticket_rows, seq)
        packed = {balance: [0] * cp for balance in BALANCES}
        for row in rows:
            work = keys_per_query(row).clamp(max=topk)
            for balance in BALANCES:
                for rank, value in enumerate(per_rank(work, cp, balance)):
                    packed[balance][rank] += value
        docs = sum(len(row) - 1 for row in rows)
        print(f"\nRows packed from {args.ticket_rows} synthetic tickets: {len(rows)} full rows, {docs} documents "
              f"(all shorter than index_topk: the indexer does not run)")
        print("\n".join(table("Sparse attention pairs:", {f"attn {b}": v for b, v in packed.items()}, cp)))

    compressed = model.kv_lora_rank + model.qk_rope_head_dim
    local = seq // cp
    bf16 = 2
    received = (cp - 1) * local
    print(f"\nPer layer and rank (bf16): all-gather of the compressed KV ({compressed} values/token) receives "
          f"{received * compressed * bf16 / 2**20:.1f} MiB, of the indexer keys ({model.index_head_dim}/token) "
          f"{received * model.index_head_dim * bf16 / 2**20:.1f} MiB (full-indexer layers only); the backward "
          f"reduce-scatters the compressed KV's gradient in fp32: {received * compressed * 4 / 2**20:.1f} MiB.")
    kv_width = model.num_attention_heads * (model.qk_nope_head_dim + model.v_head_dim)
    print(f"Gathered buffers: compressed KV {seq * compressed * bf16 / 2**20:.1f} MiB, indexer keys "
          f"{seq * model.index_head_dim * bf16 / 2**20:.1f} MiB; kv_b output (k_nope | v, {kv_width} values/key) "
          f"up to {seq * kv_width * bf16 / 2**30:.2f} GiB (head_tail rank 0: all {seq} keys; contiguous rank r: "
          f"(r + 1) x {local}); allowed and selection masks [S, T] {local * seq / 2**20:.0f} MiB each (bool).")


if __name__ == "__main__":
    main()
