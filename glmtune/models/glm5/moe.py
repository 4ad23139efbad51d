"""GLM-5 feed-forward blocks: dense SwiGLU MLP, sigmoid router, grouped experts, MoE.

Routing (fp32, on an fp32 router weight): sigmoid scores; `e_score_correction_bias`
is added for *selection only*; optional group-limited routing (`n_group`,
`topk_group`); the chosen experts' un-biased scores are normalised (+1e-20) and
scaled by `routed_scaling_factor`.

Routed experts are stored stacked — `gate_up_proj` [E, 2I, D] (gate rows first)
and `down_proj` [E, D, I], the in-memory layout of transformers — and computed over
tokens sorted by expert through `glmtune/kernels/grouped_gemm.py`: one grouped GEMM
(`grouped_mm` backend) or a loop over experts (`loop` backend, the reference). Token
movement goes through a `TokenDispatcher` (`glmtune/models/common/token_dispatch.py`,
whose routed-experts layer contract `MoE` implements: `dispatcher`, `experts`,
`num_experts`), so expert parallelism (`glmtune/distributed/expert_parallel.py`) can
replace the local one without touching the model.

Legend: T tokens, D model dim, E experts, L experts computed on this rank (E without
expert parallelism), K experts per token, I expert width, N = T*K routed (token, expert)
pairs, R rows this rank's experts compute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glmtune.kernels.fp8_matmul import grouped_linear_fp8
from glmtune.kernels.grouped_gemm import BACKENDS as MOE_BACKENDS
from glmtune.kernels.grouped_gemm import grouped_linear
from glmtune.models.common.token_dispatch import LocalTokenDispatcher, TokenDispatcher
from glmtune.models.glm5.args import Glm5Args


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); also the shared expert."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): the input of `down_proj` (MoE runs the halves apart)."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def reset_parameters(self, std: float) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)


class Router(nn.Module):
    """Sigmoid top-k router with a selection-only bias (aux-loss-free balancing)."""

    def __init__(self, args: Glm5Args) -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.top_k = args.num_experts_per_tok
        self.num_groups = args.n_group
        self.topk_groups = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        # The router weight stays fp32 whatever the model dtype (as in transformers >= 5.24).
        self.weight = nn.Parameter(torch.empty(self.num_experts, args.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (scores [T, E] fp32, top-k weights [T, K] fp32, top-k expert ids [T, K])."""
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = choice_TE.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = group_scores.topk(self.topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(-1, self.num_experts)
            choice_TE = choice_TE.masked_fill(~expert_mask.bool(), float("-inf"))
        topk_idx_TK = choice_TE.topk(self.top_k, dim=-1, sorted=False)[1]
        topk_w_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk_prob:
            topk_w_TK = topk_w_TK / (topk_w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return scores_TE, topk_w_TK * self.scaling, topk_idx_TK

    def reset_parameters(self, std: float) -> None:
        with torch.no_grad():
            self.weight.normal_(mean=0.0, std=std)
            self.e_score_correction_bias.zero_()


class GroupedExperts(nn.Module):
    """All routed experts of one layer, stacked."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, backend: str = "grouped_mm") -> None:
        super().__init__()
        if backend not in MOE_BACKENDS:
            raise ValueError(f"moe backend {backend!r} unknown; choose from {MOE_BACKENDS}")
        self.backend = backend
        self.fp8_backend: str | None = None  # set with the FP8 base (`fp8_base.convert_to_fp8_base`)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def project(self, x_NX: torch.Tensor, proj: str, offsets_E: torch.Tensor) -> torch.Tensor:
        """x through the stacked projection `proj`; a frozen FP8 base (`glmtune/models/glm5/
        fp8_base.py`) carries its block scales as `<proj>_scale_inv`."""
        scale = getattr(self, f"{proj}_scale_inv", None)
        if scale is not None:  # the W8A16 kernel under `fp8_base: triton`, else dequantized (the reference)
            backend = "triton" if getattr(self, "fp8_backend", None) == "triton" else "dequant"
            return grouped_linear_fp8(x_NX, getattr(self, proj), scale, offsets_E, backend)
        return grouped_linear(x_NX, getattr(self, proj), offsets_E, self.backend)

    def forward(self, x_ND: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0)
        gate_up_N2I = self.project(x_ND, "gate_up_proj", offsets_E)
        gate_NI, up_NI = gate_up_N2I.chunk(2, dim=-1)
        return self.project(F.silu(gate_NI) * up_NI, "down_proj", offsets_E)

    def reset_parameters(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)


class MoE(nn.Module):
    """Routed experts plus always-on shared experts."""

    def __init__(self, args: Glm5Args, backend: str = "grouped_mm") -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.gate = Router(args)
        self.experts = GroupedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size, backend)
        self.shared_experts = DenseMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher()
        # Tokens routed to each expert in the latest forward: load metrics and the
        # aux-loss-free bias update read it. Overwritten, not accumulated, so an
        # activation-checkpointing recompute does not count tokens twice.
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        _, topk_w_TK, topk_idx_TK = self.gate(x_TD)
        num_chunks = self.dispatcher.overlap_chunks
        chunks = [(x_TD, topk_idx_TK, topk_w_TK)] if num_chunks == 1 else list(zip(
            x_TD.tensor_split(num_chunks), topk_idx_TK.tensor_split(num_chunks), topk_w_TK.tensor_split(num_chunks)))
        # The shared experts need no routed row: their first half runs while the dispatch's
        # all-to-all is in flight, their second while the combine's is (expert parallelism;
        # the local dispatcher has nothing in flight). The same ops on the same operands as
        # one after the other, and backward accumulates x's gradient in the same order
        # (tests/models/test_moe_overlap.py), so the losses are bit-identical. With chunks,
        # chunk c+1's rows travel while chunk c's experts compute.
        in_flight = self.dispatcher.dispatch_start_chunks(chunks, self.num_experts)
        shared_hidden_BSI = self.shared_experts.hidden(x_BSD)
        returning, counts_E = [], []
        for rows in in_flight:
            x_RD, tokens_per_expert_L, state = self.dispatcher.dispatch_finish(rows)
            counts_E.append(state.tokens_per_expert_E)
            y_RD = self.experts(x_RD, tokens_per_expert_L)
            returning.append((self.dispatcher.combine_start(y_RD, state), state))
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts_E[0] if len(counts_E) == 1 else torch.stack(counts_E).sum(0))
        shared_BSD = self.shared_experts.down_proj(shared_hidden_BSI)
        routed = [self.dispatcher.combine_finish(y, state, x_TD.dtype) for y, state in returning]
        routed_TD = routed[0] if len(routed) == 1 else torch.cat(routed)
        return routed_TD.view_as(x_BSD) + shared_BSD

    def reset_parameters(self, std: float) -> None:
        self.gate.reset_parameters(std)
        self.experts.reset_parameters(std)
        self.shared_experts.reset_parameters(std)
        self.tokens_per_expert.zero_()


def set_moe_dispatch_backend(model: nn.Module, backend: str) -> None:
    """Selects the token-movement backend of every MoE layer of a built model (before
    expert parallelism, whose dispatchers keep the backend they find)."""
    for module in model.modules():
        if isinstance(module, MoE):
            assert isinstance(module.dispatcher, LocalTokenDispatcher), "set the backend before expert parallelism"
            module.dispatcher = LocalTokenDispatcher(backend)
