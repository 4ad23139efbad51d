"""The distillation term of `train.objective: distill`: the KL between a teacher's top-K distribution
and the student's, per supervised position, at a temperature (why these choices: docs/distill.md,
"Losses").

The teacher is known only by its K most likely tokens and their log-probabilities (at temperature
1, as a serving engine returns them). Both sides are coarsened to the same K + 1 outcomes: the K
ids, and one bucket holding the rest of the vocabulary's mass (the teacher's 1 - Σ p_i; the
student's exact mass outside the K ids, from its full softmax). With p̄, q̄ those (K+1)-point
distributions and T the temperature, each position contributes

    T² · KL(p̄_T ‖ q̄_T),   p̄_T = softmax(log p̄ / T),  q̄_T = softmax(log q̄ / T)

forward KL (teacher ‖ student: the student covers the teacher's mass), T² keeping the gradient's
size as T changes (Hinton et al. 2015). At T = 1 it is the exact KL of the two bucketed
distributions, >= 0 and 0 only when they agree.

`chunked_topk_kl` computes the sum over a micro-batch's teacher positions from the final hidden
states and the head weight, one [chunk, V] fp32 slice of logits at a time (recomputed in backward:
`torch.utils.checkpoint`), as the chunked cross-entropy does (`loss.py`). `topk_kl_reference` is
the same sum over materialized logits, the plain reference the tests hold both against.

Legend: B rows, S this rank's queries of a row, T tokens, K teacher tokens per position, N positions,
D model dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class TeacherTopK:
    """A micro-batch's teacher distributions, packed like its targets: position t of row b holds the
    teacher's K most likely next tokens after t (`ids` int64, `logps` fp32 log-probabilities, zeros
    where `mask` is False: no teacher there), and the term's weight λ and temperature."""

    ids: torch.Tensor  # [B, T, K] int64
    logps: torch.Tensor  # [B, T, K] fp32
    mask: torch.Tensor  # [B, T] bool: a teacher position (always a supervised target)
    weight: float = 0.0  # λ: the term's weight beside the cross-entropy
    temperature: float = 1.0
    # teacher positions among this rank's queries, counted on the host (None: the loss counts, a host sync)
    count: int | None = None

    @classmethod
    def on_host(cls, ids: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor,
                local_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None) -> TeacherTopK:
        """Host tensors, their teacher positions among this rank's queries (`local_tokens`: context
        parallelism's; None: every query) counted here, before they move."""
        return cls(ids, logps, mask, count=int((mask if local_tokens is None else local_tokens(mask)).sum()))

    def to(self, device: torch.device | str) -> TeacherTopK:
        return TeacherTopK(self.ids.to(device, non_blocking=True), self.logps.to(device, non_blocking=True),
                           self.mask.to(device, non_blocking=True), self.weight, self.temperature, self.count)

    def rows(self, part: slice | list[int], local_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> TeacherTopK:
        """Rows `part` of host tensors, their positions among this rank's queries counted again."""
        mask = self.mask[part]
        return TeacherTopK(self.ids[part], self.logps[part], mask, self.weight, self.temperature,
                           int((mask if local_tokens is None else local_tokens(mask)).sum()))

    def local(self, local_tokens: Callable[[torch.Tensor], torch.Tensor]) -> TeacherTopK:
        """This rank's queries of the full rows (context parallelism: [B, T, ...] -> [B, S, ...]), as the
        forward's hidden states hold them; the count is already theirs."""
        return TeacherTopK(local_tokens(self.ids), local_tokens(self.logps), local_tokens(self.mask), self.weight,
                           self.temperature, self.count)


def teacher_buckets(logps_NK: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K + 1]: the teacher's K log-probabilities and the log of the mass left outside them
    (-inf when they hold all of it, or more through rounding)."""
    logps = logps_NK.to(torch.promote_types(logps_NK.dtype, torch.float32))
    held = torch.logsumexp(logps, dim=-1).clamp_max(0.0)
    rest = torch.log1p(-torch.exp(held))  # log(1 - Σ p_i); -inf at Σ p_i = 1
    return torch.cat([logps, rest[:, None]], dim=-1)


def student_buckets(logits_NV: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    """[N, K + 1] in the logits' precision: the student's log-probabilities of the K ids and of every
    other token together (exact: the logsumexp over the vocabulary without the K ids)."""
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    picked = logits_NV.gather(1, ids_NK)
    rest = logits_NV.scatter(1, ids_NK, float("-inf"))
    return torch.cat([picked, torch.logsumexp(rest, dim=-1, keepdim=True)], dim=-1) - lse_N[:, None]


def bucket_kl(teacher_NB: torch.Tensor, student_NB: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position T² · KL(softmax(teacher / T) ‖ softmax(student / T)) over the buckets ([N]); a
    bucket the teacher gives no mass adds nothing (0 · log 0 = 0)."""
    p_log = torch.log_softmax(teacher_NB.to(student_NB.dtype) / temperature, dim=-1)
    q_log = torch.log_softmax(student_NB / temperature, dim=-1)
    terms = torch.where(p_log > float("-inf"), p_log.exp() * (p_log - q_log), torch.zeros_like(p_log))
    return temperature ** 2 * terms.sum(dim=-1)


def _chunk_kl_sum(hidden_ND, weight_VD, ids_NK, teacher_NB, temperature):
    logits_NV = F.linear(hidden_ND, weight_VD)
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))  # bf16: fp32; fp64 stays
    return bucket_kl(teacher_NB, student_buckets(logits_NV, ids_NK), temperature).sum()


def chunked_topk_kl(hidden_BSD: torch.Tensor, weight_VD: torch.Tensor, teacher: TeacherTopK,
                    chunk_size: int = 2048) -> torch.Tensor:
    """fp32 (fp64 for fp64 inputs) sum over the teacher positions (`teacher.mask`, [B, S] like the hidden states) of the
    per-position term (module docstring), without the weight λ. Only the teacher positions pay for
    the head; at most one [chunk, V] fp32 slice of logits is alive, in forward and in backward."""
    hidden_ND = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    mask_N = teacher.mask.reshape(-1)
    kept = (mask_N.nonzero() if teacher.count is None else mask_N.nonzero_static(size=teacher.count)).squeeze(1)
    hidden_ND = hidden_ND.index_select(0, kept)
    ids_NK = teacher.ids.reshape(-1, teacher.ids.shape[-1]).index_select(0, kept)
    teacher_NB = teacher_buckets(teacher.logps.reshape(-1, teacher.logps.shape[-1]).index_select(0, kept))
    total = hidden_ND.new_zeros((), dtype=torch.promote_types(hidden_ND.dtype, torch.float32))
    # At least one (possibly empty) slice: with no teacher position the sum is still a graph node.
    for start in range(0, max(hidden_ND.shape[0], 1), chunk_size):
        end = start + chunk_size
        args = (hidden_ND[start:end], weight_VD, ids_NK[start:end], teacher_NB[start:end], teacher.temperature)
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_kl_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_kl_sum(*args)
    return total


def topk_kl_reference(logits_BSV: torch.Tensor, teacher: TeacherTopK) -> torch.Tensor:
    """Reference: the same sum over materialized logits, in their precision (fp64 logits: fp64)."""
    mask = teacher.mask.reshape(-1)
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1])[mask]
    ids_NK = teacher.ids.reshape(-1, teacher.ids.shape[-1])[mask]
    teacher_NB = teacher_buckets(teacher.logps.reshape(-1, teacher.logps.shape[-1])[mask].double())
    return bucket_kl(teacher_NB, student_buckets(logits_NV, ids_NK), teacher.temperature).sum()


def distilling(teacher: TeacherTopK | None) -> bool:
    """Whether a micro-batch's loss adds the KL term (a teacher with weight λ > 0)."""
    return teacher is not None and teacher.weight > 0


def with_teacher_kl(loss_sum: torch.Tensor, hidden_BSD: torch.Tensor, weight_VD: torch.Tensor,
                    teacher: TeacherTopK, num_targets: torch.Tensor | int
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A model family's loss sum with the KL term added (`loss_sum + λ · KL sum`), and the two parts as
    statistics `ce`, `kl`: (sum, `num_targets`) pairs of this rank's queries, which the trainer sums over
    every rank and reports per supervised token (a context-parallel rank's sums are its own queries').
    The hidden states are the forward's final ones and `weight_VD` its head, gathered (inside the
    forward under FSDP2)."""
    kl = chunked_topk_kl(hidden_BSD, weight_VD, teacher)
    count = torch.as_tensor(num_targets, device=kl.device).reshape(()).float()
    return loss_sum + teacher.weight * kl, {"ce": torch.stack([loss_sum.detach().float(), count]),
                                            "kl": torch.stack([kl.detach().float(), count])}
