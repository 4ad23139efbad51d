"""Indexer recall (`indexer_recall.py`) against an explicit dense reference: per layer, the
eager attention's probabilities over every allowed key, averaged over heads, summed over the
keys the layer attended; the probe's forward hooks see exactly what the layers computed."""

import torch

from glmtune.models.common.document_masks import allowed_mask
from glmtune.models.glm5 import build_model, get_preset
from glmtune.models.glm5.indexer_recall import sampled_queries, selection_recall
from glmtune.models.glm5.spec import GLM5
from glmtune.train.data_loader import collate


def _model(topk=8):
    args = get_preset("tiny").replace(index_topk=topk)
    return build_model(args, dtype=torch.float64, attention_backend="eager", moe_backend="loop", seed=0)


def _batch(seq=40, docs=(25, 15)):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 4096, (seq,), generator=gen).tolist()
    doc_ids = [d for d, n in enumerate(docs) for _ in range(n)]
    pos = [i for n in docs for i in range(n)]
    return collate([{"input_ids": ids, "labels": ids, "position_ids": pos, "document_ids": doc_ids}])


def test_sampling_takes_only_queries_with_a_real_selection_evenly():
    allowed = allowed_mask(1, 40, "cpu", None, torch.tensor([[0] * 25 + [1] * 15]))
    picked = sampled_queries(allowed, topk=8)[0]
    assert picked.tolist() == list(range(8, 25)) + list(range(33, 40))  # > 8 allowed keys
    assert sampled_queries(allowed, topk=8, per_row=3)[0].tolist() == [8, 19, 39]  # first, middle, last of 24


def test_recall_matches_the_dense_reference_layer_by_layer():
    model = _model()
    batch = _batch()
    captured = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o: captured.append((m, a, o)))
             for layer in model.model.layers]
    with torch.no_grad():
        metrics = GLM5.compute.serving_metrics(model, batch)
    for h in hooks:
        h.remove()
    total, count = 0.0, 0
    for attention, args, output in captured:
        x, cos, sin, allowed = args[:4]
        with torch.no_grad():
            q, _, latent, k_rot = attention.project(x, cos, sin)
            k, _ = attention.keys_and_values(latent, k_rot)
        scores = torch.einsum("bnsk,bntk->bnst", q, k) * attention.scale
        probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).mean(1)  # [B, S, T]
        mass = (probs * output[1][0]).sum(-1)
        eligible = allowed.sum(-1) > attention.index_topk
        total += float(mass[eligible].sum())
        count += int(eligible.sum())
        assert bool((mass[eligible] < 1 - 1e-6).any())  # top-8 of 25 keys leaves mass out
    recall = metrics["indexer_recall"]
    assert int(recall[1]) == count == 4 * 24  # four layers (two share), 24 queries with > 8 keys
    torch.testing.assert_close(float(recall[0]), total, rtol=1e-5, atol=0)
    assert 0 < float(recall[0]) / count < 1
    assert metrics["mtp_acceptance"][1] > 0


def test_a_selection_of_every_key_has_recall_one():
    model = _model(topk=64)  # more than any document: every allowed key is selected
    batch = _batch()
    allowed = allowed_mask(1, 40, "cpu", None, batch["document_ids"])
    picked = [torch.tensor([10, 20, 39])]
    q = torch.randn(1, 2, 40, 4, dtype=torch.float64)
    k = torch.randn(1, 2, 40, 4, dtype=torch.float64)
    pair = selection_recall(q, k, 0.5, allowed, allowed, picked)
    torch.testing.assert_close(pair, torch.tensor([3.0, 3.0]))
    assert GLM5.compute.serving_metrics(model, batch)["indexer_recall"].tolist() == [0.0, 0.0]  # none qualifies
