"""The DSA indexer's KL loss (`train.indexer_loss_weight`) in fp64 against an explicit reference.

The reference materializes everything the op chunks: per layer, the main attention's
probabilities over all keys ([B, N, S, T] from the layer's own projections), the selection as
an explicit top-k of the indexer's full [B, S, T] scores (GLM-5.2's shared layers reuse the
latest full layer's selection and scores), p = the heads' probabilities summed and
L1-normalized over the selection (detached), q = softmax of the scores (from the detached
layer input) over the selection, and KL(p || q) summed over the non-padding queries. The loss
the trainer differentiates is LM mean + weight x KL sum / (queries x layers), by plain autograd.
"""

import pytest
import torch
import torch.nn.functional as F

from glmtune.models.common.aux_loss import AuxiliaryLosses, AuxiliaryScales
from glmtune.models.common.loss import IGNORE_INDEX
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.rope import apply_interleaved_rope
from glmtune.models.glm5 import build_model, get_preset, indexer_loss
from glmtune.models.glm5.model import DecoderLayer
from glmtune.models.glm5.parallelize import apply_activation_checkpointing, split_model

# per row: document lengths (then padding): a packed row and a one-document row, both longer than top-k
DOCS = [[13, 7], [24]]
SEQ, TOPK, WEIGHT = 24, 6, 0.3


def _batch(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids, doc_ids, pos = [], [], []
    for docs in DOCS:
        pad = SEQ - sum(docs)
        ids.append(torch.randint(1, vocab, (SEQ,), generator=gen).tolist())
        doc_ids.append([d for d, n in enumerate(docs) for _ in range(n)] + [-1] * pad)
        pos.append([i for n in docs for i in range(n)] + list(range(pad)))
    batch = {"input_ids": torch.tensor(ids), "document_ids": torch.tensor(doc_ids), "position_ids": torch.tensor(pos)}
    same_doc = batch["document_ids"][:, 1:] == batch["document_ids"][:, :-1]
    targets = torch.where(same_doc & (batch["document_ids"][:, 1:] >= 0), batch["input_ids"][:, 1:], IGNORE_INDEX)
    return batch, torch.cat([targets, torch.full((len(DOCS), 1), IGNORE_INDEX)], dim=1)


def _model(topk=TOPK, seed=0, mtp=False):
    args = get_preset("tiny").replace(index_topk=topk)
    model = build_model(args, dtype=torch.float64, attention_backend="eager", moe_backend="loop", seed=seed)
    model.set_trainable_extras(mtp=mtp, indexer=True)
    return model


def _main_probs(attn, x, cos, sin, selected_BST):
    """The attention's head-summed probabilities over the selection, L1-normalized: [B, S, T]."""
    batch, seq, _ = x.shape
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(batch, seq, attn.num_heads, -1).transpose(1, 2)
    q_nope, q_rot = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_rank, attn.rope_dim], dim=-1)
    kv = attn.kv_b_proj(attn.kv_a_layernorm(latent)).view(batch, seq, attn.num_heads, -1).transpose(1, 2)
    k_nope = kv[..., :attn.nope_dim]
    q_rot = apply_interleaved_rope(q_rot, cos.unsqueeze(1), sin.unsqueeze(1))
    k_rot = apply_interleaved_rope(k_rot.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1))
    q = torch.cat([q_nope, q_rot], dim=-1)
    k = torch.cat([k_nope, k_rot.expand(-1, attn.num_heads, -1, -1)], dim=-1)
    logits = (q @ k.transpose(-1, -2) * attn.scale).masked_fill(~selected_BST.unsqueeze(1), float("-inf"))
    p = logits.softmax(-1).sum(1)
    return (p / p.sum(-1, keepdim=True)).detach()


def _layer_kl(layer, h, cos, sin, allowed, queries, topk, owner):
    """(KL sum over `queries`, the selection's owner (scores, selection)) of one layer."""
    x = layer.input_layernorm(h)
    attn = layer.self_attn
    if attn.indexer is not None:
        q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        q, k, w = attn.indexer.project(x.detach(), q_resid.detach(), cos, sin)  # a graph to the indexer only
        # Indexer.combine's formula, in fp64 (the model's scores are fp32 whatever its dtype)
        scores = w.double().unsqueeze(-2) @ torch.relu(q @ k.transpose(-1, -2).unsqueeze(1) * attn.index_softmax_scale)
        scores = scores.squeeze(-2)
        top = scores.detach().masked_fill(~allowed, float("-inf")).topk(min(topk, allowed.shape[-1])).indices
        owner = (scores, allowed & torch.zeros_like(allowed).scatter(-1, top, True))
    scores, selected = owner
    p = _main_probs(attn, x, cos, sin, selected)
    log_q = scores.double().masked_fill(~selected, float("-inf")).log_softmax(-1)
    kl_BS = torch.where(selected, torch.xlogy(p, p) - p * log_q.masked_fill(~selected, 0.0), 0.0).sum(-1)
    return kl_BS[queries].sum(), owner


def _reference(model, batch, targets, topk, mtp_targets=None):
    """(LM loss sum, MTP loss sum or None, KL sum over layers and queries, KL terms)."""
    core = model.model
    ids, docs = batch["input_ids"], batch["document_ids"]
    h = core.embed_tokens(ids)
    inputs = core.layer_inputs(*ids.shape, h.device, h.dtype, batch["position_ids"], docs)
    queries = docs >= 0
    kl, owner, selection = 0.0, None, None
    for layer in core.layers:
        layer_kl, owner = _layer_kl(layer, h, inputs.cos, inputs.sin, inputs.allowed_BST, queries, topk, owner)
        kl = kl + layer_kl
        h, selection = layer(h, inputs.cos, inputs.sin, inputs.allowed_BST, selection, inputs.plain_causal,
                             topk < SEQ)  # a top-k of the whole row: dense attention
    hidden = core.norm(h)
    lm = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    layers, mtp = len(core.layers), None
    if mtp_targets is not None:
        layer = model.mtp[0]
        next_ids = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], core.padding_idx)], dim=1)
        x = layer.eh_proj(torch.cat([layer.enorm(core.embed_tokens(next_ids)), layer.hnorm(hidden)], dim=-1))
        layer_kl, _ = _layer_kl(layer, x, inputs.cos, inputs.sin, inputs.allowed_BST, queries, topk, None)
        kl, layers = kl + layer_kl, layers + 1
        y, _ = DecoderLayer.forward(layer, x, inputs.cos, inputs.sin, inputs.allowed_BST, None, inputs.plain_causal,
                                    topk < SEQ)
        mtp = F.cross_entropy(model.lm_head(layer.shared_head.norm(y)).flatten(0, 1), mtp_targets.flatten(),
                              ignore_index=IGNORE_INDEX, reduction="sum")
    return lm, mtp, kl, int(queries.sum()) * layers


def _tolerance(name: str) -> dict:
    # The indexers' gradients come from the KL alone, in fp64 but for the head weights (fp32 in every
    # model, Indexer.project); the main model's through the fused loss (fp32).
    fp64 = ".indexer." in name and "weights_proj" not in name
    return dict(rtol=1e-8, atol=1e-13) if fp64 else dict(rtol=1e-5, atol=1e-7)


def _grads(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _queries(batch) -> int:
    return int((batch["document_ids"] >= 0).sum())


def _forward(model, batch, targets, aux=None, mtp_targets=None, **kw):
    """`model` over `batch`'s rows: the micro-batch of their positions, documents and targets, `aux`
    sizing the auxiliary losses."""
    mb = MicroBatch(**batch, targets=targets, mtp_targets=mtp_targets, aux=aux)
    return model(batch["input_ids"], mb, compute_logits=False, **kw)


def _unit_kl(batch, layers=4) -> AuxiliaryScales:
    """The indexer KL differentiated with factor 1 (its weight is the queries x KL layers it divides by)."""
    return AuxiliaryScales(AuxiliaryLosses(indexer_weight=float(_queries(batch) * layers)), queries=_queries(batch))


def _train_forward(model, batch, targets, warmup=False):
    # WEIGHT / (queries x layers) the factor of each layer's KL
    aux = AuxiliaryScales(AuxiliaryLosses(indexer_weight=WEIGHT), queries=_queries(batch), indexer_warmup=warmup)
    out = _forward(model, batch, targets, aux, loss_chunk_size=7)
    (out.loss_sum / int((targets != IGNORE_INDEX).sum())).backward()
    return out


# the op's paths: dense chunks only; gathered selections (short chunks, both paths in one row); the auto rule
@pytest.mark.parametrize("gather,chunk_bytes", [(False, indexer_loss.CHUNK_BYTES), (True, 13824), (None, 13824)])
def test_kl_and_gradients_match_the_explicit_reference(monkeypatch, gather, chunk_bytes):
    monkeypatch.setattr(indexer_loss, "GATHER", gather)
    monkeypatch.setattr(indexer_loss, "CHUNK_BYTES", chunk_bytes)
    model = _model()
    batch, targets = _batch(model.args.vocab_size)
    out = _train_forward(model, batch, targets)
    grads = _grads(model)
    assert {name for name in grads if ".indexer." in name} == {
        f"model.layers.{i}.self_attn.indexer.{p}" for i in (0, 2)
        for p in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")}

    lm, _, kl, terms = _reference(model, batch, targets, TOPK)
    n = int((targets != IGNORE_INDEX).sum())
    (lm / n + WEIGHT * kl / terms).backward()
    ref = _grads(model)
    torch.testing.assert_close(out.indexer_kl, torch.stack([kl, torch.tensor(terms, dtype=kl.dtype)]).detach(),
                               rtol=1e-10, atol=0)
    assert out.indexer_kl[0] > 0 and terms == 4 * (20 + 24)
    torch.testing.assert_close(out.loss_sum.double(), lm.detach(), rtol=1e-6, atol=0)  # the fused loss is fp32
    assert ref.keys() == grads.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], **_tolerance(name), msg=name)


def test_gradients_reach_only_the_indexers_and_leave_the_main_model_as_the_lm_loss_trains_it():
    model = _model()
    batch, targets = _batch(model.args.vocab_size)
    out = _forward(model, batch, targets)
    out.loss_sum.backward()
    plain = _grads(model)
    assert not any(".indexer." in name for name in plain)
    with_kl = _forward(model, batch, targets, _unit_kl(batch))
    assert torch.equal(with_kl.loss_sum, out.loss_sum)  # the forward is unchanged
    with_kl.loss_sum.backward()
    grads = _grads(model)
    for name, grad in plain.items():
        assert torch.equal(grads[name], grad), name
    assert set(grads) - set(plain) == {n for n, p in model.named_parameters() if ".indexer." in n and "mtp." not in n}


def test_shared_layers_train_the_indexer_they_reuse():
    model = _model()
    batch, _ = _batch(model.args.vocab_size)
    core = model.model
    h0 = core.embed_tokens(batch["input_ids"])
    inputs = core.layer_inputs(len(DOCS), SEQ, h0.device, h0.dtype, batch["position_ids"], batch["document_ids"],
                               indexer_kl=True, indexer_grad_scale=1.0)
    h, selection = core.run_layers(core.layers[:2], h0, inputs)  # layer 1 ("shared") reuses layer 0's selection
    assert len(selection) == 3  # the owner's projections travel with its selection
    h.backward(torch.zeros_like(h))  # the KLs alone
    wq_b = core.layers[0].self_attn.indexer.wq_b.weight
    got, wq_b.grad = wq_b.grad, None

    queries = batch["document_ids"] >= 0
    kl_full, owner = _layer_kl(core.layers[0], h0, inputs.cos, inputs.sin, inputs.allowed_BST, queries, TOPK, None)
    h1, _ = core.layers[0](h0, inputs.cos, inputs.sin, inputs.allowed_BST, None, False, True)
    kl_shared, _ = _layer_kl(core.layers[1], h1, inputs.cos, inputs.sin, inputs.allowed_BST, queries, TOPK, owner)
    torch.testing.assert_close(inputs.indexer_kl.stats[0], (kl_full + kl_shared).detach(), rtol=1e-10, atol=0)
    full_only = torch.autograd.grad(kl_full, wq_b, retain_graph=True)[0]
    both = torch.autograd.grad(kl_full + kl_shared, wq_b)[0]
    torch.testing.assert_close(got, both, rtol=1e-8, atol=1e-14)
    assert (both - full_only).abs().max() > 1e-3 * both.abs().max()  # the shared layer's share is real


def test_the_mtp_layers_indexer_trains_when_the_mtp_layer_runs():
    model = _model(mtp=True)
    batch, targets = _batch(model.args.vocab_size)
    mtp_targets = torch.cat([targets[:, 1:], torch.full((len(DOCS), 1), IGNORE_INDEX)], dim=1)
    terms = int((batch["document_ids"] >= 0).sum()) * 5
    m = int((mtp_targets != IGNORE_INDEX).sum())
    # 0.5 / m the MTP loss's factor, WEIGHT / terms the KL's
    aux = AuxiliaryScales(AuxiliaryLosses(0.5, WEIGHT), mtp_targets=m, queries=_queries(batch))
    out = _forward(model, batch, targets, aux, mtp_targets)
    n = int((targets != IGNORE_INDEX).sum())
    (out.loss_sum / n).backward()
    grads = _grads(model)
    assert "mtp.0.self_attn.indexer.wq_b.weight" in grads
    lm, mtp, kl, ref_terms = _reference(model, batch, targets, TOPK, mtp_targets)
    assert ref_terms == terms == int(out.indexer_kl[1])
    (lm / n + 0.5 * mtp / m + WEIGHT * kl / terms).backward()
    ref = _grads(model)
    torch.testing.assert_close(out.indexer_kl[0], kl.detach(), rtol=1e-10, atol=0)
    assert ref.keys() == grads.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], **_tolerance(name), msg=name)


@pytest.mark.parametrize("mode,warmup", [("full", False), ("selective", False), ("selective", True)])
def test_activation_checkpointing_gives_the_same_gradients(mode, warmup):
    batch, targets = _batch(4096)
    eager = _model()
    out = _train_forward(eager, batch, targets, warmup=warmup)
    want = _grads(eager)
    checkpointed = _model()
    apply_activation_checkpointing(checkpointed, mode, keep_matmul_min_k=32)
    got_out = _train_forward(checkpointed, batch, targets, warmup=warmup)
    got = _grads(checkpointed)
    assert torch.equal(got_out.indexer_kl, out.indexer_kl)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=0, msg=name)


def test_compiled_layers_equal_eager():
    batch, targets = _batch(4096)
    eager = _model()
    out = _train_forward(eager, batch, targets)
    want = _grads(eager)
    compiled = _model()
    for layer in compiled.model.layers[:2]:  # a full layer and the shared layer reusing its selection
        layer.compile(backend="aot_eager", fullgraph=True)
    got_out = _train_forward(compiled, batch, targets)
    got = _grads(compiled)
    torch.testing.assert_close(got_out.indexer_kl, out.indexer_kl, rtol=1e-12, atol=0)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-14, msg=name)


def test_warmup_attends_densely_and_trains_only_the_indexers():
    model = _model()
    batch, targets = _batch(model.args.vocab_size)
    out = _train_forward(model, batch, targets, warmup=True)
    grads = _grads(model)
    assert grads and all(".indexer." in name for name in grads)
    assert not out.loss_sum.grad_fn.name().startswith("_FusedLinear")  # a detached main loss, carrying the KL
    # dense: the LM loss and the KL of a model whose top-k selects every key
    lm, _, kl, terms = _reference(model, batch, targets, topk=SEQ)
    torch.testing.assert_close(out.loss_sum.double(), lm.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(out.indexer_kl[0], kl.detach(), rtol=1e-10, atol=0)
    (WEIGHT * kl / terms).backward()
    ref = _grads(model)
    assert ref.keys() == grads.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], **_tolerance(name), msg=name)

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    _train_forward(model, batch, targets, warmup=True)
    optimizer.step()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(".indexer." in name for name in changed)


def test_without_gradients_the_kl_is_reported_only():
    model = _model()
    batch, targets = _batch(model.args.vocab_size)
    with torch.no_grad():
        out = _forward(model, batch, targets, _unit_kl(batch))
        reported = AuxiliaryScales(AuxiliaryLosses(indexer_weight=1.0), indexer_warmup=True)  # no step's queries
        dense = _forward(model, batch, targets, reported)
    _, _, kl, terms = _reference(model, batch, targets, TOPK)
    torch.testing.assert_close(out.indexer_kl[0], kl.detach(), rtol=1e-10, atol=0)
    assert dense.indexer_kl[0] != out.indexer_kl[0] and int(dense.indexer_kl[1]) == terms


def test_a_pipeline_with_trained_indexers_starts_stages_on_full_indexer_layers():
    def split(explicit, indexer=True):
        model = build_model(get_preset("tiny"), device="meta")  # ['full', 'shared', 'full', 'shared']
        model.set_trainable_extras(mtp=False, indexer=indexer)
        split_model(model, pp=2, pp_rank=0, schedule="1F1B", stages_per_rank=1, seq_len=512, explicit_split=explicit)
        return model.layers_per_stage

    with pytest.raises(ValueError, match=r"parallel.pp_layer_split \[1, 3\] starts a stage on shared-indexer"):
        split([1, 3])
    assert split([2, 2]) == [2, 2] and split(None) == [2, 2]
    assert split([1, 3], indexer=False) == [1, 3]  # frozen indexers: any split
