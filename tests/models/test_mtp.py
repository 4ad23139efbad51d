"""The multi-token-prediction loss (`train.mtp_loss_weight`) in fp64 against an explicit reference.

The reference spells GLM-5's MTP out from the model's pieces: the main model's final-normed
state h[t] and the embedding of token t+1 through eh_proj([enorm(e); hnorm(h)]), the MTP
decoder layer under the main model's block-causal mask, shared_head.norm and the main
lm_head, scored against labels[t+2] of the same document; its targets are found by walking
each document, not by `packing.second_next_targets`. Gradients: the loss the trainer
differentiates, LM mean + weight x MTP mean, by plain autograd.
"""

import pytest
import torch

from glmtune.data.packing import next_token_targets, second_next_targets
from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.model import DecoderLayer

# two documents and padding in one row, and a row that is one document; prompts unsupervised
DOCS = [[(9, 4), (7, 2)], [(20, 5)]]  # per row: (document length, prompt tokens) ...
SEQ = 20


def _rows(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for docs in DOCS:
        ids, labels, doc_ids, pos = [], [], [], []
        for d, (length, prompt) in enumerate(docs):
            tokens = torch.randint(1, vocab, (length,), generator=gen).tolist()
            ids += tokens
            labels += [IGNORE_INDEX] * prompt + tokens[prompt:]
            doc_ids += [d] * length
            pos += list(range(length))
        pad = SEQ - len(ids)
        rows.append({"input_ids": ids + [0] * pad, "labels": labels + [IGNORE_INDEX] * pad,
                     "document_ids": doc_ids + [-1] * pad, "position_ids": pos + list(range(pad))})
    return rows


def _reference_targets(labels, document_ids):
    out = [IGNORE_INDEX] * len(labels)
    for t in range(len(labels)):
        doc = document_ids[t]
        end = t
        while end + 1 < len(labels) and document_ids[end + 1] == doc:
            end += 1
        if doc >= 0 and t + 2 <= end:  # token t+2 in t's document
            out[t] = labels[t + 2]
    return out


def _batch(rows):
    return {key: torch.tensor([r[key] for r in rows]) for key in ("input_ids", "position_ids", "document_ids")}


def _model(seed=0, topk=6):
    args = get_preset("tiny").replace(index_topk=topk)
    model = build_model(args, dtype=torch.float64, attention_backend="eager", moe_backend="loop", seed=seed)
    model.set_trainable_extras(mtp=True, indexer=False)
    return model


def _reference_mtp_sum(model, batch, mtp_targets):
    core = model.model
    ids = batch["input_ids"]
    hidden, inputs = core.hidden_and_inputs(ids, batch["position_ids"], batch["document_ids"])
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    layer = model.mtp[0]
    x = layer.eh_proj(torch.cat([layer.enorm(core.embed_tokens(next_ids)), layer.hnorm(hidden)], dim=-1))
    y, _ = DecoderLayer.forward(layer, x, inputs.cos, inputs.sin, inputs.allowed_BST, None, inputs.plain_causal,
                                inputs.sparse_needed)
    logits = model.lm_head(layer.shared_head.norm(y))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mtp_targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")


def test_targets_stay_in_their_document_and_on_supervised_tokens():
    rows = _rows(4096)
    for row in rows:
        got = second_next_targets(row["labels"], row["document_ids"])
        assert got == _reference_targets(row["labels"], row["document_ids"])
    first = second_next_targets(rows[0]["labels"], rows[0]["document_ids"])
    assert first[7:9] == [IGNORE_INDEX] * 2 and first[16:] == [IGNORE_INDEX] * 4  # document ends, padding
    assert first[:2] == [IGNORE_INDEX] * 2 and first[2] == rows[0]["labels"][4]  # prompt: no target


@pytest.mark.parametrize("topk", [6, 64])  # a real top-k selection in the MTP layer's indexer, and none
def test_mtp_loss_and_gradients_match_the_explicit_reference(topk):
    model = _model(topk=topk)
    rows = _rows(model.args.vocab_size)
    batch = _batch(rows)
    targets = torch.tensor([r["labels"][1:] + [IGNORE_INDEX] for r in rows])
    mtp_targets = torch.tensor([_reference_targets(r["labels"], r["document_ids"]) for r in rows])
    n, m, weight = int((targets != IGNORE_INDEX).sum()), int((mtp_targets != IGNORE_INDEX).sum()), 0.3

    aux = AuxiliaryScales(AuxiliaryLosses(mtp_weight=weight), mtp_targets=m)  # the MTP loss's factor: weight / m
    out = model(batch["input_ids"], MicroBatch(**batch, targets=targets, mtp_targets=mtp_targets, aux=aux),
                compute_logits=False, loss_chunk_size=7)
    (out.loss_sum / n).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert any(name.startswith("mtp.0.eh_proj") for name in grads)
    assert all(".indexer." not in name for name in grads)
    model.zero_grad(set_to_none=True)

    logits = model(batch["input_ids"], MicroBatch(**batch)).logits
    lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           ignore_index=IGNORE_INDEX, reduction="sum")
    mtp = _reference_mtp_sum(model, batch, mtp_targets)
    (lm / n + weight * mtp / m).backward()
    torch.testing.assert_close(out.mtp_loss_sum, mtp.float(), rtol=1e-6, atol=0)  # the loss sums are fp32
    assert int(out.mtp_num_targets) == m
    torch.testing.assert_close(out.loss_sum.double(), lm, rtol=1e-6, atol=0)
    ref = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert ref.keys() == grads.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)  # the fused loss computes in fp32


def test_without_a_gradient_scale_the_mtp_loss_is_reported_and_not_trained():
    model = _model()
    rows = _rows(model.args.vocab_size)
    batch = _batch(rows)
    targets = torch.tensor([r["labels"][1:] + [IGNORE_INDEX] for r in rows])
    mtp_targets = torch.tensor([second_next_targets(r["labels"], r["document_ids"]) for r in rows])
    out = model(batch["input_ids"], MicroBatch(**batch, targets=targets, mtp_targets=mtp_targets), compute_logits=False)
    out.loss_sum.backward()
    assert out.mtp_loss_sum > 0
    assert all(p.grad is None for name, p in model.named_parameters() if name.startswith("mtp."))


@pytest.mark.parametrize("grad", [False, True])
def test_mtp_acceptance_counts_the_drafts_the_model_itself_would_emit(grad):
    """Against the logits' own argmax: the greedy tokens the acceptance compares come out of the two
    losses' slices (no head pass of their own), with and without gradients (the fused loss)."""
    model = _model()
    rows = _rows(model.args.vocab_size)
    batch = _batch(rows)
    targets = torch.tensor([next_token_targets(r["labels"]) for r in rows])
    mtp_targets = torch.tensor([_reference_targets(r["labels"], r["document_ids"]) for r in rows])
    with torch.no_grad() if not grad else torch.enable_grad():
        out = model(batch["input_ids"], MicroBatch(**batch, targets=targets, mtp_targets=mtp_targets),
                    loss_chunk_size=5)
    with torch.no_grad():
        greedy = out.logits.argmax(-1)  # the main model's token after t+1, at position t+1
        drafted = model.lm_head(out.mtp_hidden_states).argmax(-1)
    scored = mtp_targets != IGNORE_INDEX
    assert (scored[:, :-1] <= (targets[:, 1:] != IGNORE_INDEX)).all()  # glmtune's targets: t+1 supervised
    expected = ((drafted[:, :-1] == greedy[:, 1:]) & scored[:, :-1]).sum()
    assert out.mtp_accepted.tolist() == [float(expected), float(scored.sum())]
    # a position whose t+1 the main loss does not supervise has no greedy token there: left out
    with torch.no_grad():
        out = model(batch["input_ids"], MicroBatch(**batch, targets=mtp_targets, mtp_targets=mtp_targets))
    counted = scored[:, :-1] & (mtp_targets[:, 1:] != IGNORE_INDEX)
    assert out.mtp_accepted.tolist() == [float(((drafted[:, :-1] == greedy[:, 1:]) & counted).sum()),
                                         float(counted.sum())]
    # a layer that drafts the main model's own token is always accepted
    model.mtp[0].shared_head.norm.weight.data.zero_()  # every draft is token 0 (all logits 0: argmax 0)
    with torch.no_grad():
        out = model(batch["input_ids"], MicroBatch(**batch, targets=targets, mtp_targets=mtp_targets))
    assert out.mtp_accepted[0] == ((greedy[:, 1:] == 0) & scored[:, :-1]).sum()
