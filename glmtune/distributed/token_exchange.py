"""Token dispatchers for expert parallelism: routed tokens travel to the rank that holds
their expert, and the experts' outputs travel back, with autograd through both trips.

The experts of a layer are split evenly over the ranks of an ep group: rank r holds the
L = E / ep experts [r*L, (r+1)*L). Both dispatchers hand the experts the same rows in the
same order (grouped by local expert, then by source rank, then by (token, k) pair) and
apply the routing weights in fp32 before any sum, as the local dispatcher does:

- `AllToAllTokenDispatcher` (the default): per-expert counts exchanged, then each row sent
  only where its expert lives (`all_to_all_single_autograd`, uneven splits); the way back
  is the same exchange reversed, and the weights are applied on the rank that routed the
  token. Traffic ~ T*K rows per rank.
- `AllGatherTokenDispatcher` (fallback and reference): every rank gathers every rank's
  tokens and routing, computes its experts on the rows routed to them, and the fp32
  partial sums are reduce-scattered back. Traffic ~ ep*T rows per rank.

Under full activation checkpointing, the all-to-all dispatcher's exchanges in a layer's
recomputation can replay what its forward received instead of sending again
(`exchange_keeper.py`, `parallel.ep_keep_exchanges`).

Legend: T tokens of this rank, D model dim, E experts, L local experts, K experts per
token, N = T*K routed pairs of this rank, R rows this rank's experts compute, P ep
ranks, G = P*Tmax gathered tokens (each rank's tokens padded to the largest T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

try:  # torch >= 2.13 names them *_single; torch 2.11 (the GPU image) *_tensor, deprecated in 2.13
    from torch.distributed._functional_collectives import (
        all_gather_single,
        all_gather_single_autograd,
        reduce_scatter_single_autograd,
    )
except ImportError:
    from torch.distributed._functional_collectives import all_gather_tensor as all_gather_single
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd
    from torch.distributed._functional_collectives import (
        reduce_scatter_tensor_autograd as reduce_scatter_single_autograd,
    )
from torch.distributed.device_mesh import DeviceMesh

from glmtune.distributed import exchange_keeper, paired_overlap
from glmtune.distributed.exchange_keeper import Keeper
from glmtune.models.common.token_dispatch import (
    DispatchState,
    LocalDispatchState,
    LocalTokenDispatcher,
    TokenDispatcher,
    count_per_expert,
    permute_rows,
    sort_permutation,
)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


class _EpGroup:
    """The ep process group of a dispatcher, from a group or a 1-D device mesh."""

    def __init__(self, ep_group: dist.ProcessGroup | DeviceMesh, num_local_experts: int) -> None:
        if isinstance(ep_group, DeviceMesh):
            assert ep_group.ndim == 1, f"an ep mesh is 1-D, got {ep_group.mesh_dim_names}"
            ep_group = ep_group.get_group()
        self.group = ep_group
        self.size = dist.get_world_size(ep_group)
        self.rank = dist.get_rank(ep_group)
        self.num_local_experts = num_local_experts


@dataclass
class AllToAllState(DispatchState):
    local: LocalDispatchState  # the on-rank sort by global expert, undone last
    send_splits: list[int]  # rows sent to each ep rank (host ints)
    recv_splits: list[int]  # rows received from each ep rank
    order_R: torch.Tensor  # expert-major position -> received row
    inverse_R: torch.Tensor  # received row -> expert-major position


class _Transfer:
    """One all-to-all of rows whose wait and issue are apart, in forward and in backward.

    `_SendRows` issues the rows in forward and, in backward, waits for their gradient;
    `_ReceiveRows` waits for the rows in forward and, in backward, issues their gradient's
    transfer. Autograd runs backward nodes latest-created first, so the backward transfer
    is issued where forward waited and waited where forward issued: the ops forward ran
    between the two halves (the shared experts, another chunk's experts) run again, as
    their gradients, while the gradient travels. (torch's `all_to_all_single_autograd`
    waits inside its backward: nothing overlaps it.)
    """

    def __init__(self, group: dist.ProcessGroup, send_splits: list[int], recv_splits: list[int]) -> None:
        self.group, self.send_splits, self.recv_splits = group, send_splits, recv_splits
        self.work: dist.Work | None = None
        self.tensors: tuple[torch.Tensor, ...] = ()  # kept alive until the transfer is waited

    def issue(self, x_ND: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        assert self.work is None, "one transfer in flight at a time"
        x_ND = x_ND.contiguous()
        out = x_ND.new_empty(out_rows, *x_ND.shape[1:])
        self.work = dist.all_to_all_single(out, x_ND, out_splits, in_splits, group=self.group, async_op=True)
        self.tensors = (x_ND, out)
        return out

    def wait(self) -> None:
        self.work.wait()
        self.work, self.tensors = None, ()


class _KeptRows:
    """A transfer a recomputation replays (`exchange_keeper`): the rows its forward received, handed
    back without sending anything. Its autograd nodes are the recomputation's, which no backward runs."""

    def __init__(self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> None:
        self.rows, self.send_splits, self.recv_splits = rows, send_splits, recv_splits

    def issue(self, x_ND: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        assert self.rows.shape == (out_rows, *x_ND.shape[1:]), (self.rows.shape, out_rows, x_ND.shape)
        return self.rows.detach()  # a new tensor object: the kept one never joins a graph

    def wait(self) -> None:
        pass


class _SendRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
        ctx.transfer = transfer
        return transfer.issue(x_ND, sum(transfer.recv_splits), transfer.recv_splits, transfer.send_splits)

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):  # noqa: ARG004 (already on its way: `_ReceiveRows.backward`)
        grad_ND = ctx.transfer.tensors[1]
        ctx.transfer.wait()
        return grad_ND, None


class _ReceiveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RD: torch.Tensor, transfer: _Transfer) -> torch.Tensor:
        transfer.wait()
        ctx.transfer, ctx.num_sent = transfer, sum(transfer.send_splits)
        return rows_RD

    @staticmethod
    def backward(ctx, grad_RD: torch.Tensor):
        # The gradient leaves here; `_SendRows.backward` waits for it and returns it.
        transfer = ctx.transfer
        transfer.issue(grad_RD, ctx.num_sent, transfer.send_splits, transfer.recv_splits)
        return grad_RD, None


def _send_rows(x_ND: torch.Tensor, group: dist.ProcessGroup, send_splits: list[int], recv_splits: list[int],
               kept: torch.Tensor | None = None, hands_over: bool = False) -> tuple[torch.Tensor, _Transfer | None]:
    """Issues the rows' all-to-all: (the rows, not yet received, and the transfer that
    `_received` waits for); with `kept`, a recomputation's replay of it (`_KeptRows`). Compiled, it
    is torch's functional collective (waited where first used). `hands_over`: a paired forward and
    backward take turns here, after the issue (`paired_overlap.handed_over`)."""
    if torch.compiler.is_compiling():
        return all_to_all_single_autograd(x_ND, recv_splits, send_splits, group), None
    transfer = _Transfer(group, send_splits, recv_splits) if kept is None else _KeptRows(kept, send_splits, recv_splits)
    rows = _SendRows.apply(x_ND, transfer)
    return (paired_overlap.handed_over(rows) if hands_over else rows), transfer


def _on_host(counts: torch.Tensor, hands_over: bool) -> torch.Tensor:
    """`counts` copied to the host, for split sizes. A blocking copy waits for every kernel queued on the
    stream, so under the pairs (`hands_over`) it would drain the other side's queued kernels too and leave
    the stream idle until the next launch: there the copy is only started, the host handed to the other
    side (`paired_overlap.hand_over`, a no-op when no pair runs) while it lands, and then waited for."""
    if not hands_over:
        return counts.cpu()
    landed = None
    if counts.is_cuda:
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
    else:
        host = counts
    paired_overlap.hand_over()
    if landed is not None:
        landed.synchronize()
    return host


def _keeper(exchange: str) -> Keeper | None:
    """The running checkpointed call's keeper, when it keeps `exchange` (`exchange_keeper`)."""
    keeper = exchange_keeper.current()
    return keeper if keeper is not None and keeper.keeps(exchange) else None


def _replayed(exchange: str) -> Any:
    """What the forward received from `exchange`, when a recomputation replays it; else None."""
    keeper = _keeper(exchange)
    return keeper.take(exchange) if keeper is not None and keeper.replaying else None


def _record(exchange: str, item: Any) -> None:
    """Keeps what `exchange` received, when the running forward records it for its recomputation."""
    keeper = _keeper(exchange)
    if keeper is not None and not keeper.replaying:
        keeper.keep(exchange, item)


def _received(rows: torch.Tensor, transfer: _Transfer | None) -> torch.Tensor:
    return rows if transfer is None else _ReceiveRows.apply(rows, transfer)


@dataclass
class _RowsInFlight:
    """`AllToAllTokenDispatcher.dispatch_start`'s result: the received rows (an all-to-all not
    yet waited), in [source rank][local expert] order, and what `dispatch_finish` needs."""

    rows: torch.Tensor
    transfer: _Transfer | None
    tokens_per_expert_L: torch.Tensor
    state: AllToAllState


class AllToAllTokenDispatcher(TokenDispatcher):
    """Expert parallelism with two all-to-alls per layer, forward and backward alike.

    Args:
        ep_group: the ep process group, or a 1-D device mesh of it.
        num_local_experts: L, experts per rank (E / ep).
        local: the on-rank sort and weighted combine (its backend: torch or triton).
        overlap_chunks: C, the chunks a layer splits its tokens into so that one chunk's
            all-to-alls travel while another chunk's experts compute (`TokenDispatcher`).

    `hands_over` (set by the parallelization plan under `parallel.pp_ep_overlap`): each row exchange,
    forward and backward, hands the host to a paired microbatch once issued (`paired_overlap`).
    """

    hands_over = False

    def __init__(self, ep_group: dist.ProcessGroup | DeviceMesh, num_local_experts: int,
                 local: LocalTokenDispatcher | None = None, overlap_chunks: int = 1) -> None:
        if overlap_chunks < 1:
            raise ValueError(f"ep overlap chunks must be at least 1, got {overlap_chunks}")
        self.ep = _EpGroup(ep_group, num_local_experts)
        self.local = local if local is not None else LocalTokenDispatcher()
        self.overlap_chunks = overlap_chunks

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        return self.dispatch_finish(self.dispatch_start(x_TD, topk_idx_TK, topk_w_TK, num_experts))

    def dispatch_start(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> _RowsInFlight:
        """Sends the rows and returns with the all-to-all in flight (not waited)."""
        return self.dispatch_start_chunks([(x_TD, topk_idx_TK, topk_w_TK)], num_experts)[0]

    def dispatch_start_chunks(
        self, chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_experts: int
    ) -> list[_RowsInFlight]:
        """Sends every chunk's rows, one all-to-all each, and returns with all of them in flight.

        The counts of all chunks travel in one exchange with one host sync, so no chunk's counts
        queue behind another chunk's rows."""
        ep, num_local, num_chunks = self.ep.size, self.ep.num_local_experts, len(chunks)
        assert num_experts == ep * num_local, (num_experts, ep, num_local)
        # Sorted by global expert id, the rows are already grouped by destination rank.
        sorted_chunks = [self.local.dispatch(x, idx, w, num_experts) for x, idx, w in chunks]
        # send_PCL[p, c, l]: chunk c's rows for rank p's local expert l (a block per destination).
        send_PCL = torch.stack([counts for _, counts, _ in sorted_chunks]).view(num_chunks, ep, num_local)
        send_PCL = send_PCL.transpose(0, 1).contiguous()
        kept_counts = _replayed("dispatch_counts")
        if kept_counts is not None:  # a recomputation: the forward's counts, no sync
            recv_PCL, splits_2PC, forward_send_PCL = kept_counts
            # Checkpointing's premise, that the recomputation routes as the forward did, checked on the
            # device (no sync): rows sent by the forward's split sizes would otherwise reach wrong experts.
            torch._assert_async(torch.eq(send_PCL, forward_send_PCL).all(),
                                "the recomputation routed tokens otherwise than its forward: kept expert counts differ")
        else:
            # recv_PCL[s, c, l]: rows of chunk c that rank s sends to this rank's local expert l.
            recv_PCL = _wait(all_to_all_single(send_PCL.view(-1), None, None, group=self.ep.group))
            recv_PCL = recv_PCL.view(ep, num_chunks, num_local)
            # The one device-to-host sync of the layer: the collectives take split sizes as host
            # ints. Both count tables come over in a single copy.
            splits_2PC = _on_host(torch.stack([send_PCL, recv_PCL]).sum(3), self.hands_over)
            _record("dispatch_counts", (recv_PCL, splits_2PC, send_PCL))
        return [self._send(x_ND, counts_E, local, recv_PCL[:, c], splits_2PC[0, :, c].tolist(),
                           splits_2PC[1, :, c].tolist(), _replayed("dispatch"))
                for c, (x_ND, counts_E, local) in enumerate(sorted_chunks)]

    def _send(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor, local: LocalDispatchState,
              recv_PL: torch.Tensor, send_splits: list[int], recv_splits: list[int],
              kept: torch.Tensor | None) -> _RowsInFlight:
        ep, num_local = self.ep.size, self.ep.num_local_experts
        # Waited in `dispatch_finish`.
        x_RD, transfer = _send_rows(x_ND, self.ep.group, send_splits, recv_splits, kept, self.hands_over)
        # Received rows come as [source rank][local expert]; the grouped GEMM wants them
        # local-expert-major. A stable sort by local expert keeps the source ranks in order.
        block_R = torch.repeat_interleave(torch.arange(ep * num_local, device=x_ND.device), recv_PL.reshape(-1),
                                          output_size=sum(recv_splits))
        _, order_R, inverse_R = sort_permutation(block_R % num_local)
        state = AllToAllState(tokens_per_expert_E, local, send_splits, recv_splits, order_R, inverse_R)
        return _RowsInFlight(x_RD, transfer, recv_PL.sum(0), state)

    def dispatch_finish(self, in_flight: _RowsInFlight) -> tuple[torch.Tensor, torch.Tensor, AllToAllState]:
        state = in_flight.state
        x_RD = _received(in_flight.rows, in_flight.transfer)
        _record("dispatch", x_RD.detach())
        return permute_rows(x_RD, state.order_R, state.inverse_R), in_flight.tokens_per_expert_L, state

    def combine(self, y_RD: torch.Tensor, state: AllToAllState, out_dtype: torch.dtype) -> torch.Tensor:
        return self.combine_finish(self.combine_start(y_RD, state), state, out_dtype)

    def combine_start(self, y_RD: torch.Tensor, state: AllToAllState) -> tuple[torch.Tensor, _Transfer | None]:
        """Sends the outputs back (the way they came: the splits reversed); waited in `combine_finish`."""
        y_RD = permute_rows(y_RD, state.inverse_R, state.order_R)
        return _send_rows(y_RD, self.ep.group, state.recv_splits, state.send_splits, _replayed("combine"),
                          self.hands_over)

    def combine_finish(self, in_flight: tuple[torch.Tensor, _Transfer | None], state: AllToAllState,
                       out_dtype: torch.dtype) -> torch.Tensor:
        rows_ND = _received(*in_flight)
        _record("combine", rows_ND.detach())
        return self.local.combine(rows_ND, state.local, out_dtype)


@dataclass
class AllGatherState(DispatchState):
    num_tokens: int  # T of this rank
    max_tokens: int  # the largest T in the ep group: every rank's share of the gathered rows
    token_R: torch.Tensor  # gathered token index of each computed row
    weight_R: torch.Tensor  # its routing weight (fp32, gathered with autograd)


class AllGatherTokenDispatcher(TokenDispatcher):
    """Expert parallelism by gathering every rank's tokens: simple, ep times the traffic.

    Args:
        ep_group: the ep process group, or a 1-D device mesh of it.
        num_local_experts: L, experts per rank (E / ep).
    """

    def __init__(self, ep_group: dist.ProcessGroup | DeviceMesh, num_local_experts: int) -> None:
        self.ep = _EpGroup(ep_group, num_local_experts)

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, AllGatherState]:
        ep, num_local = self.ep.size, self.ep.num_local_experts
        assert num_experts == ep * num_local, (num_experts, ep, num_local)
        num_tokens, top_k = topk_idx_TK.shape
        tokens_per_expert_E = count_per_expert(topk_idx_TK.reshape(-1), num_experts)
        # Every rank's token count and routing counts, in one gather and one host sync (the
        # gathers below need the largest T; the local rows' place in the sort, the counts).
        meta = torch.cat([tokens_per_expert_E.new_tensor([num_tokens]), tokens_per_expert_E])
        meta_P1E = _wait(all_gather_single(meta, 0, self.ep.group)).view(ep, 1 + num_experts)
        meta_host = meta_P1E.cpu()
        first, last = 1 + self.ep.rank * num_local, 1 + (self.ep.rank + 1) * num_local
        max_tokens = int(meta_host[:, 0].max())
        rows_before = int(meta_host[:, 1:first].sum())  # pairs routed to experts below ours
        num_rows = int(meta_host[:, first:last].sum())

        # Pad every rank to the largest T; padded pairs get expert id E and sort last.
        pad = max_tokens - num_tokens
        x_GD = all_gather_single_autograd(F.pad(x_TD, (0, 0, 0, pad)), 0, self.ep.group)
        # Gathered with autograd: the router's gradient comes back through the weights.
        w_GK = all_gather_single_autograd(F.pad(topk_w_TK, (0, 0, 0, pad)), 0, self.ep.group)
        idx_GK = _wait(all_gather_single(F.pad(topk_idx_TK, (0, 0, 0, pad), value=num_experts), 0, self.ep.group))

        # Sorted by expert, then source rank, then pair: the all-to-all dispatcher's row order.
        _, order = torch.sort(idx_GK.reshape(-1), stable=True)
        pair_R = order[rows_before:rows_before + num_rows]
        token_R = pair_R // top_k
        x_RD = x_GD.index_select(0, token_R)
        weight_R = w_GK.reshape(-1).index_select(0, pair_R)
        tokens_per_expert_L = meta_P1E[:, first:last].sum(0)
        return x_RD, tokens_per_expert_L, AllGatherState(tokens_per_expert_E, num_tokens, max_tokens, token_R, weight_R)

    def combine(self, y_RD: torch.Tensor, state: AllGatherState, out_dtype: torch.dtype) -> torch.Tensor:
        weighted_RD = y_RD.float() * state.weight_R.unsqueeze(-1)
        # fp32 partial sums over this rank's experts (index_add: atomics on CUDA, so the order
        # of a token's terms may vary run to run), summed over the ranks by the reduce-scatter.
        partial_GD = weighted_RD.new_zeros(self.ep.size * state.max_tokens, y_RD.shape[-1])
        partial_GD = partial_GD.index_add(0, state.token_R, weighted_RD)
        out_TD = reduce_scatter_single_autograd(partial_GD, "sum", 0, self.ep.group)
        return out_TD[:state.num_tokens].to(out_dtype)
