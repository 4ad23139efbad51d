"""Preference-optimization losses (the DPO family) over packed rows, exactly as TRL computes them.

A pair's sequence log-probability is the sum of its completion tokens' log-probabilities
(the model family's `token_logps`), summed per packed document here. In a
packed preference row, documents 2i and 2i+1 are the chosen and rejected answers of pair i
(the data layer's convention), so both halves of a pair are in one micro-batch and padding-free
packing is kept: `document_sums` of a row equals TRL's per-sequence sums over its padded batch.

With Δ = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)) (sums over completion
tokens; w chosen, l rejected), β `beta`, ε `label_smoothing`:

  sigmoid  DPO (Rafailov et al. 2023, arXiv:2305.18290), with ε > 0 conservative DPO (cDPO,
           Mitchell 2023): −(1 − ε) log σ(βΔ) − ε log σ(−βΔ). TRL 1.16's `DPOTrainer._compute_loss`
           ("sigmoid") has ε = 0 only; the ε form is TRL's earlier `DPOTrainer.dpo_loss` (and its
           "aot" loss on a batch of one pair, which the test compares against).
  ipo      IPO (Azar et al. 2023, arXiv:2310.12036, Eq. 17): (Δ_w/n_w − Δ_l/n_l − 1/(2β))², the log
           ratios averaged over each completion's n tokens (clamped to 1), as TRL 1.16 does
           (`_compute_loss`, "ipo"; confirmed with the IPO authors, says its comment).
  robust   robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), ε = label-flip rate in [0, 0.5):
           (−(1 − ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)   (TRL 1.16 `_compute_loss`, "robust").
  reference "none": SimPO (Meng et al. 2024, arXiv:2405.14734), no reference model, length-normalized:
           with a = log π(y)/n, z = a_w − a_l − γ/β:  −(1 − ε) log σ(βz) − ε log σ(−βz)
           (TRL 1.16 `trl/experimental/cpo/cpo_trainer.py`, `CPOTrainer.cpo_loss` with loss_type "simpo",
           sequence averages from `get_batch_logps(average_log_prob=True)`).
  SFT term (RPO, Pang et al. 2024, arXiv:2404.19733): `sft_weight` × the NLL of the chosen tokens
           averaged PER TOKEN over all chosen tokens of the batch, −Σ log π(y_w) / Σ n_w (not per
           sequence): TRL 1.16 `_compute_loss` loss type "sft" (`-chosen_per_token_logps[chosen_mask]
           .mean()`, weighted by `loss_weights`), and the same for CPO's `cpo_alpha` NLL term.

The batch loss is the mean of the per-pair loss over the batch's pairs plus the SFT term
(`total_loss`). Rewards for metrics: β(log π − log π_ref) per answer (SimPO: β × average log π).

Legend: B rows, S tokens of a row, D document slots of a row, P pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from glmtune.models.common.loss import IGNORE_INDEX

LOSS_TYPES = ("sigmoid", "ipo", "robust")
REFERENCES = ("model", "none")


def document_sums(values_BS: torch.Tensor, document_ids_BS: torch.Tensor, num_documents: int) -> torch.Tensor:
    """fp32 [B, num_documents]: the sum of `values_BS` over each packed document of each row.

    `document_ids_BS` are 0, 1, ... per row, -1 for padding (ignored). Differentiable in values.
    Slots past a row's last document hold 0.
    """
    # Padding goes to one extra slot, dropped after: a scatter needs a valid index for every token.
    slots_BS = torch.where(document_ids_BS < 0, num_documents, document_ids_BS).long()
    sums = values_BS.new_zeros(values_BS.shape[0], num_documents + 1, dtype=torch.float32)
    return sums.scatter_add(1, slots_BS, values_BS.float())[:, :num_documents]


def document_token_counts(targets_BS: torch.Tensor, document_ids_BS: torch.Tensor, num_documents: int) -> torch.Tensor:
    """fp32 [B, num_documents]: supervised targets (!= -100) per packed document."""
    return document_sums((targets_BS != IGNORE_INDEX).float(), document_ids_BS, num_documents)


def pairs(doc_sums_BD: torch.Tensor, num_documents_per_row: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen_P, rejected_P): documents 2i and 2i+1 of each row, rows in order, flattened.

    `num_documents_per_row` (host ints, e.g. from the data loader) skips the empty slots past
    each row's documents; no host sync.
    """
    rows, slots = [], []
    for row, num_documents in enumerate(num_documents_per_row):
        if num_documents % 2:
            raise ValueError(f"row {row} holds {num_documents} documents: a preference row holds pairs")
        rows += [row] * (num_documents // 2)
        slots += range(0, num_documents, 2)
    rows_P = torch.tensor(rows, dtype=torch.long, device=doc_sums_BD.device)
    slots_P = torch.tensor(slots, dtype=torch.long, device=doc_sums_BD.device)
    return doc_sums_BD[rows_P, slots_P], doc_sums_BD[rows_P, slots_P + 1]


def pair_logps(token_logps_BS: torch.Tensor, targets_BS: torch.Tensor, document_ids_BS: torch.Tensor,
               num_documents_per_row: Sequence[int]) -> dict[str, torch.Tensor]:
    """Per-pair sequence log-probabilities and completion-token counts of packed preference rows.

    Returns {"chosen", "rejected"} (sums of `token_logps_BS` per document) and
    {"chosen_tokens", "rejected_tokens"} (supervised targets per document), each [P].
    Under context parallelism the per-document sums of the local tokens must still be summed
    over the cp group before the loss (the caller's all-reduce).
    """
    num_documents = max(num_documents_per_row, default=0)
    logps = pairs(document_sums(token_logps_BS, document_ids_BS, num_documents), num_documents_per_row)
    counts = pairs(document_token_counts(targets_BS, document_ids_BS, num_documents), num_documents_per_row)
    return {"chosen": logps[0], "rejected": logps[1], "chosen_tokens": counts[0], "rejected_tokens": counts[1]}


def _smoothed_sigmoid(logits_P: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(beta * logits_P) - label_smoothing * F.logsigmoid(-beta * logits_P)


def preference_loss(
    policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None, *,
    chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, loss: str = "sigmoid", beta: float = 0.1,
    label_smoothing: float = 0.0, reference: str = "model", simpo_gamma: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [P] and per-pair stats (formulas and sources in the module docstring).

    Args:
        policy_chosen, policy_rejected: [P] sums of the policy's log-probabilities over each
            completion's tokens (`pair_logps`).
        ref_chosen, ref_rejected: [P] the same under the reference (no gradient); None when
            `reference` is "none".
        chosen_tokens, rejected_tokens: [P] completion tokens per answer (ipo and SimPO average).
        loss: "sigmoid" (DPO; cDPO with `label_smoothing`), "ipo" or "robust".
        reference: "model" (DPO family) or "none" (SimPO: `loss` must be "sigmoid").
        simpo_gamma: SimPO's target reward margin γ (the loss uses γ/β on the averages).

    Stats (detached, [P]): rewards_chosen, rewards_rejected, margin (their difference), accuracy
    (1.0 where the chosen reward is higher), logps_chosen, logps_rejected (policy sums).
    """
    if loss not in LOSS_TYPES:
        raise ValueError(f"preference loss {loss!r} unknown; choose from {LOSS_TYPES}")
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r} unknown; choose from {REFERENCES}")
    if reference == "none":
        if loss != "sigmoid":
            raise ValueError(f"reference 'none' is SimPO, a sigmoid loss; loss {loss!r} needs a reference model")
        # TRL's get_batch_logps(average_log_prob=True): sum / count, no clamp.
        chosen_scores, rejected_scores = policy_chosen / chosen_tokens, policy_rejected / rejected_tokens
        per_pair = _smoothed_sigmoid(chosen_scores - rejected_scores - simpo_gamma / beta, beta, label_smoothing)
    else:
        chosen_scores, rejected_scores = policy_chosen - ref_chosen, policy_rejected - ref_rejected
        delta = chosen_scores - rejected_scores
        if loss == "sigmoid":
            per_pair = _smoothed_sigmoid(delta, beta, label_smoothing)
        elif loss == "ipo":
            ipo_delta = chosen_scores / chosen_tokens.clamp(min=1.0) - rejected_scores / rejected_tokens.clamp(min=1.0)
            per_pair = (ipo_delta - 1 / (2 * beta)) ** 2
        else:
            if not 0.0 <= label_smoothing < 0.5:
                raise ValueError(f"robust DPO's label_smoothing (a flip rate) must lie in [0, 0.5), "
                                 f"got {label_smoothing}")
            clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
            flipped = -label_smoothing * F.logsigmoid(-beta * delta)
            per_pair = (clean - flipped) / (1 - 2 * label_smoothing)
    rewards_chosen, rewards_rejected = beta * chosen_scores.detach(), beta * rejected_scores.detach()
    stats = {
        "rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected,
        "margin": rewards_chosen - rewards_rejected, "accuracy": (rewards_chosen > rewards_rejected).float(),
        "logps_chosen": policy_chosen.detach(), "logps_rejected": policy_rejected.detach(),
    }
    return per_pair, stats


def total_loss(per_pair_loss: torch.Tensor, policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor, *,
               sft_weight: float = 0.0, num_pairs: int | None = None,
               num_chosen_tokens: int | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, sft_loss): mean per-pair loss + `sft_weight` × the per-token mean NLL of chosen tokens.

    `num_pairs` and `num_chosen_tokens` are the counts of the whole batch (the optimizer step,
    over micro-batches and data-parallel ranks) when known on the host; omitted, this
    micro-batch's. With the step's counts, the micro-batches' losses add up to TRL's batch loss
    (`per_sequence_loss.mean()` + weight × `-chosen_per_token_logps[chosen_mask].mean()`).
    """
    num_pairs = per_pair_loss.shape[0] if num_pairs is None else num_pairs
    num_chosen_tokens = chosen_tokens.sum() if num_chosen_tokens is None else num_chosen_tokens
    sft_loss = -policy_chosen.sum() / num_chosen_tokens
    loss = per_pair_loss.sum() / num_pairs
    if sft_weight:
        loss = loss + sft_weight * sft_loss
    return loss, sft_loss.detach()
