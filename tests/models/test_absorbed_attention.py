"""`attention_backend: absorbed` (MLA's absorbed form over each query's selected keys) against
"eager" (transformers' arithmetic): one MLA layer's output and the gradients of every trained
parameter and of the input, for a one-document row past top-k, a packed row, a row shorter
than top-k and a context-parallel rank's pieces; the op itself in small blocks against a
float64 reference; the whole tiny model; the config's acceptance and refusals.

Tolerances. fp32: both sides compute the same sums in different association orders
(q (W_uk c) against (q W_uk) c, and the scatter-added key gradients), each exact to fp32's
unit roundoff 2^-24 ~ 6e-8 times a few dozen terms: 1e-5 relative (of the tensor's norm).
bf16: each side rounds its inputs, q W_uk (absorbed) or W_uk c (eager), P, and every output
to 8 significant bits (unit roundoff 2^-9 ~ 2e-3); both are compared with the fp32 result
of the same weights, and the absorbed error must stay within 1.5 x eager's own error plus
2^-9 (an error of the same kind and size, not a different function)."""

import pytest
import torch

from glmtune.config import load_config, validate_config
from glmtune.config.validate import absorbed_attention_errors, device_errors
from glmtune.models.common.document_masks import allowed_mask, longest_document
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.rope import RotaryEmbedding
from glmtune.models.common.sequence_shard import SequenceShard
from glmtune.models.glm5 import absorbed_attention as aa
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.attention import MLAttention
from glmtune.models.glm5.model import build_model
from glmtune.models.glm5.parallelize import apply_activation_checkpointing
from glmtune.models.registry import model_dims
from tests.models import test_indexer_loss as kl_tests

TOPK = 12
ARGS = get_preset("tiny").replace(index_topk=TOPK)


def _layers(dtype):
    """An eager and an absorbed layer with the same weights (std 0.1: peaked attention); no indexer
    of their own: both take the same selection (`_selection`), so that a rounding cannot move it."""
    torch.manual_seed(0)
    eager = MLAttention(ARGS, has_indexer=False, backend="eager")
    eager.reset_parameters(0.1)
    absorbed = MLAttention(ARGS, has_indexer=False, backend="absorbed")
    absorbed.load_state_dict(eager.state_dict())
    return eager.to(dtype), absorbed.to(dtype)


def _row(case: str):
    """(positions [1, T], one document per row?, the shard or None) of a 2-row batch."""
    if case == "packed":  # documents of 22 and 18 tokens: both past top-k
        return torch.cat([torch.arange(22), torch.arange(18)]).unsqueeze(0), False, None
    if case == "short":
        return torch.arange(TOPK - 2).unsqueeze(0), True, None
    # cp: rank 1 of 2 (head_tail): queries 10-19 and 20-29 of 40, one piece (the last rank's chunks touch),
    # so rank 0 of 4 instead: pieces [0, 5) (the causal prefix) and [35, 40).
    return torch.arange(40).unsqueeze(0), True, (SequenceShard(0, 4, "head_tail", gather=None) if case == "cp" else None)


def _selection(allowed_BST, sparse_needed: bool):
    """The selection a layer gets from an earlier one: TOPK random allowed keys per query (all of
    them for a query with fewer), or the allowed mask itself when no query has more."""
    if not sparse_needed:
        return allowed_BST, True
    scores = torch.rand(allowed_BST.shape, generator=torch.Generator().manual_seed(3)).masked_fill(~allowed_BST, -1)
    top = scores.topk(TOPK, dim=-1).indices
    return allowed_BST & torch.zeros_like(allowed_BST).scatter(-1, top, True), False


def _run(layer, x_full, positions, single_document, shard, dtype):
    """Output [B, S, D] of `layer` and the gradients (of the local output) of its parameters and
    input. Under a shard the gather returns the full row: other ranks' tokens from the same layer
    on the full input (detached), this rank's from its own tensor (with its gradient)."""
    batch, seq_len, _ = x_full.shape
    index = None if shard is None else shard.query_index(seq_len)
    x = (x_full if index is None else x_full[:, index]).detach().requires_grad_()
    allowed = allowed_mask(batch, seq_len, x.device, positions, query_index_S=index)
    sparse_needed = longest_document(seq_len, positions, None) > TOPK
    if shard is not None:
        shard = SequenceShard(shard.rank, shard.size, shard.balance, gather=_full_row_gather(layer, x_full, index))
    cos, sin = _rope(positions if index is None else positions[:, index], batch, dtype)
    selection = _selection(allowed, sparse_needed)
    out, _ = layer(x, cos, sin, allowed, selection, single_document, sparse_needed, shard)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads["input"] = x.grad
    return out.detach(), grads


def _rope(positions_1S, batch, dtype):
    rope = RotaryEmbedding(ARGS.rope_parameters, ARGS.qk_rope_head_dim, ARGS.max_position_embeddings)
    return rope(positions_1S.expand(batch, -1), dtype)


def _full_row_gather(layer, x_full, index):
    cos, sin = _rope(torch.arange(x_full.shape[1]).unsqueeze(0), x_full.shape[0], x_full.dtype)
    with torch.no_grad():
        _, _, latent, k_rot = layer.project(x_full, cos, sin)
    full = torch.cat([latent, k_rot.squeeze(1)], dim=-1)
    return lambda local: full.index_copy(1, index, local)


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


CASES = ["one_document", "packed", "short", "cp"]


@pytest.mark.parametrize("case", CASES)
def test_layer_matches_eager_in_fp32(case, monkeypatch):
    monkeypatch.setattr(aa, "BLOCK_BYTES", 1)  # one query per block: the block loops and scatter-adds
    monkeypatch.setattr(aa, "INDEX_BYTES", 1)
    positions, single_document, shard = _row(case)
    eager, absorbed = _layers(torch.float32)
    x = torch.randn(2, positions.shape[1], ARGS.hidden_size, generator=torch.Generator().manual_seed(2))
    want, want_grads = _run(eager, x, positions, single_document, shard, torch.float32)
    got, got_grads = _run(absorbed, x, positions, single_document, shard, torch.float32)
    assert _rel(got, want) <= 1e-5
    assert got_grads.keys() == want_grads.keys() and "kv_b_proj.weight" in got_grads
    for name, grad in want_grads.items():
        assert _rel(got_grads[name], grad) <= 1e-5, name


def assert_fused_backend_matches_absorbed(case: str) -> None:
    """"absorbed_triton" (Triton's fused kernels; run by tests/kernels/test_sparse_mla.py in the
    interpreter) against "absorbed" in one MLA layer, fp32: output and every gradient (1e-5, the
    two sum the same terms in different orders)."""
    positions, single_document, shard = _row(case)
    _, absorbed = _layers(torch.float32)
    fused = MLAttention(ARGS, has_indexer=False, backend="absorbed_triton")
    fused.load_state_dict(absorbed.state_dict())
    x = torch.randn(2, positions.shape[1], ARGS.hidden_size, generator=torch.Generator().manual_seed(2))
    want, want_grads = _run(absorbed, x, positions, single_document, shard, torch.float32)
    got, got_grads = _run(fused, x, positions, single_document, shard, torch.float32)
    assert _rel(got, want) <= 1e-5 and got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert _rel(got_grads[name], grad) <= 1e-5, (case, name)


def test_fused_backend_is_refused_off_the_gpu():
    """Without CUDA (and outside Triton's interpreter) the layer says which backend to use instead."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs the fused backend")
    positions, single_document, shard = _row("one_document")
    fused = MLAttention(ARGS, has_indexer=False, backend="absorbed_triton")
    x = torch.randn(2, positions.shape[1], ARGS.hidden_size)
    with pytest.raises(ValueError, match="'absorbed_triton' runs Triton kernels on a CUDA GPU; use 'absorbed'"):
        _run(fused, x, positions, single_document, shard, torch.float32)


@pytest.mark.parametrize("case", CASES)
def test_layer_matches_eager_in_bf16(case):
    positions, single_document, shard = _row(case)
    (eager, absorbed) = _layers(torch.bfloat16)
    x = torch.randn(2, positions.shape[1], ARGS.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact, exact_grads = _run(_layers(torch.bfloat16)[0].double(), x.double(), positions, single_document, shard,
                              torch.float64)
    want, want_grads = _run(eager, x, positions, single_document, shard, torch.bfloat16)
    got, got_grads = _run(absorbed, x, positions, single_document, shard, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert _rel(got, exact) <= 1.5 * _rel(want, exact) + 2**-9
    for name, grad in exact_grads.items():
        assert _rel(got_grads[name], grad) <= 1.5 * _rel(want_grads[name], grad) + 2**-9, name


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 3 queries (of 5 heads, 6 slots, 8 wide) and index blocks of 2: every loop runs several times."""
    monkeypatch.setattr(aa, "BLOCK_BYTES", 3 * 6 * (8 * 8 + 5 * 16))
    monkeypatch.setattr(aa, "INDEX_BYTES", 2 * 16 * 2 * 11)


def _op_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    batch, queries, heads, keys, width, slots = 2, 7, 5, 11, 8, 6
    q = torch.randn(batch, queries, heads, width, generator=g).to(dtype).requires_grad_()
    c = torch.randn(batch, keys, width, generator=g).to(dtype).requires_grad_()
    sparse = (torch.rand(batch, queries, keys, generator=g) < 0.4) & (torch.rand(batch, queries, keys, generator=g)
                                                                      < 0.9)
    sparse &= sparse.cumsum(-1) <= slots  # at most `slots` keys per query
    sparse[0, 3] = False
    sparse[0, 3, [1, 9]] = True  # a query with fewer keys than slots
    sparse[1, 5] = False
    sparse[1, 5, 4] = True  # a query with one key
    return q, c, sparse, slots


def _float64_reference(q, c, sparse, scale, value_dim):
    logits = torch.einsum("bsnc,btc->bsnt", q.double(), c.double()) * scale
    probs = logits.masked_fill(~sparse.unsqueeze(2), float("-inf")).softmax(-1)
    return torch.einsum("bsnt,btr->bsnr", probs, c.double()[..., :value_dim]), logits


def test_selected_keys_lists_each_querys_keys_in_order(small_blocks):
    _, _, sparse, slots = _op_inputs(torch.float32)
    index, valid = aa.selected_keys(sparse, slots)
    for b in range(sparse.shape[0]):
        for s in range(sparse.shape[1]):
            keys = sparse[b, s].nonzero().squeeze(-1)
            assert torch.equal(index[b, s, :len(keys)], keys) and bool((index[b, s, len(keys):] == 0).all())
            assert valid[b, s].tolist() == [i < len(keys) for i in range(slots)]
    with pytest.raises((IndexError, RuntimeError)):  # more selected keys than slots: never a silent drop
        aa.selected_keys(torch.ones(1, 2, 9, dtype=torch.bool), 4)


def _split(q, c, value_dim: int):
    """`absorbed_sparse_attention`'s operands: the queries' and keys' latent and rope parts (views)."""
    return q[..., :value_dim], q[..., value_dim:], c[..., :value_dim], c[..., value_dim:]


def test_op_matches_float64_reference_in_blocks(small_blocks):
    q, c, sparse, slots = _op_inputs(torch.float32)
    scale, value_dim = 0.4, 6
    out = aa.absorbed_sparse_attention(*_split(q, c, value_dim), sparse, scale, slots)
    index, valid = aa.selected_keys(sparse, slots)
    lse = aa.absorbed_attention(q, c, index, valid, scale, value_dim)[1]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dc = torch.autograd.grad(out, (q, c), grad)
    ref, logits = _float64_reference(q, c, sparse, scale, value_dim)
    rq, rc = torch.autograd.grad(ref, (q, c), grad.double())
    for mine, theirs in ((out, ref), (dq, rq), (dc, rc)):
        assert torch.allclose(mine.double(), theirs.double(), atol=1e-5), (mine.double() - theirs.double()).abs().max()
    ref_lse = logits.masked_fill(~sparse.unsqueeze(2), float("-inf")).logsumexp(-1)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_bf16_rounds_like_flash_attention(small_blocks):
    """bf16 inputs: fp32 scores and key-gradient sums, P and dS rounded once to bf16."""
    q, c, sparse, slots = _op_inputs(torch.bfloat16)
    out = aa.absorbed_sparse_attention(*_split(q, c, 6), sparse, 0.4, slots)
    dq, dc = torch.autograd.grad(out, (q, c), torch.ones_like(out))
    ref, _ = _float64_reference(q, c, sparse, 0.4, 6)
    rq, rc = torch.autograd.grad(ref, (q, c), torch.ones_like(ref))
    assert out.dtype == dq.dtype == dc.dtype == torch.bfloat16
    for mine, theirs in ((out, ref), (dq, rq), (dc, rc)):  # a few bf16 roundings (2^-9) of O(1) values
        assert _rel(mine, theirs) < 2e-2


def test_op_registration_is_consistent():
    q, c, sparse, slots = _op_inputs(torch.float32)
    index, valid = aa.selected_keys(sparse, slots)
    torch.library.opcheck(aa.selected_keys, (sparse, slots))
    torch.library.opcheck(aa.absorbed_attention, (q, c, index, valid, 0.4, 6))


@pytest.mark.parametrize("packed", [False, True])
def test_tiny_model_trains_like_eager(packed):
    """The whole tiny model (its indexers selecting top-12 of 40-token rows): loss and gradient
    norm, and every parameter's gradient, as "eager" computes them (fp32)."""
    args = get_preset("tiny").replace(index_topk=TOPK)
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(25), torch.arange(15)]).unsqueeze(0) if packed else None
    results = []
    for backend in ("eager", "absorbed"):
        model = build_model(args, attention_backend=backend, seed=0)
        out = model(x, MicroBatch(x, positions, targets=torch.roll(x, -1, 1)))
        loss = out.loss_sum / out.num_targets
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), torch.cat([g.flatten() for g in grads.values()]).norm().item(), grads))
    (loss, norm, grads), (got_loss, got_norm, got_grads) = results
    assert abs(got_loss - loss) <= 1e-5 * loss and abs(got_norm - norm) <= 1e-5 * norm
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert _rel(got_grads[name], grad) <= 1e-4, name


RECIPE = "recipes/tiny/sft_support_json.yaml"


def _validate(*overrides: str) -> None:
    cfg = load_config(RECIPE, ["--model.attention_backend", "absorbed", *overrides])
    dims = model_dims(cfg.model)
    validate_config(cfg, dims.num_experts, dims.num_layers, world_size=1)


def test_config_accepts_absorbed_and_builds_it():
    _validate()
    _validate("--peft.method", "lora")  # the default targets leave kv_b_proj alone
    cfg = load_config(RECIPE, ["--model.attention_backend", "absorbed"])
    assert cfg.model.attention_backend == "absorbed"
    model = build_model(ARGS, attention_backend=cfg.model.attention_backend)
    assert {layer.self_attn.backend for layer in model.model.layers} == {"absorbed"}


def test_config_refuses_what_absorbed_cannot_multiply_by():
    with pytest.raises(ValueError, match="attention_backend: absorbed reads kv_b_proj's base weight directly"):
        _validate("--peft.method", "lora", "--peft.target_modules", '["*.self_attn.kv_b_proj"]')
    _validate("--peft.method", "lora", "--peft.target_modules", '["*.self_attn.*"]',
              "--peft.exclude_modules", '["*.kv_b_proj"]')
    cfg = load_config(RECIPE, ["--model.attention_backend", "absorbed", "--peft.method", "lora"])
    cfg.model.fp8_base = "dequant"  # an HF directory's setting (a preset refuses it first)
    assert any("cannot take model.fp8_base: dequant" in e for e in absorbed_attention_errors(cfg))


def test_config_refuses_the_fused_backend_where_it_cannot_run():
    """absorbed_triton: the absorbed refusals, and a CPU device or an fp32 model."""
    gpu = ["--train.device", "cuda", "--model.dtype", "bfloat16"]
    assert absorbed_attention_errors(load_config(RECIPE, ["--model.attention_backend", "absorbed_triton", *gpu])) == []
    cfg = load_config(RECIPE, ["--model.attention_backend", "absorbed_triton", "--train.device", "cpu",
                               "--model.dtype", "float32", "--peft.method", "lora", "--peft.target_modules",
                               '["*.kv_b_proj"]'])
    errors = absorbed_attention_errors(cfg)
    assert len(errors) == 3 and all(e.startswith("model.attention_backend: absorbed_triton") for e in errors)
    assert "not train.device: cpu" in errors[1] and "not model.dtype: float32" in errors[2]
    # train.device: auto is checked where it resolves (`check_recipe`, `plan --measure`, preflight)
    auto = load_config(RECIPE, ["--model.attention_backend", "absorbed_triton", "--train.device", "auto",
                                "--model.dtype", "bfloat16"])
    assert device_errors(auto, "cuda") == [] and device_errors(load_config(RECIPE, []), "cpu") == []
    assert device_errors(auto, "cpu") == ["model.attention_backend: absorbed_triton runs Triton kernels on a CUDA "
                                          "GPU, and train.device: auto found none here (it runs on cpu); use "
                                          "absorbed, its pure-torch form"]


@pytest.mark.parametrize("warmup", [False, True])
def test_indexer_kl_trains_as_with_eager(warmup):
    """With `train.indexer_loss_weight > 0` the layer expands kv_b over the keys for the KL only; the
    KL, the loss and every gradient equal eager's (the warm-up attends densely: more slots than
    top-k). The model is float64 but its token losses are summed in fp32 (unit roundoff 6e-8): a
    float64 difference may move a result by an fp32 rounding, hence 1e-6 relative (2e-6 of a
    gradient's norm), not float64's 1e-15."""
    batch, targets = kl_tests._batch(4096)
    results = []
    for backend in ("eager", "absorbed"):
        model = kl_tests._model()
        for module in model.modules():
            if isinstance(module, MLAttention):
                module.backend = backend
        out = kl_tests._train_forward(model, batch, targets, warmup=warmup)
        results.append((out.indexer_kl, out.loss_sum, kl_tests._grads(model)))
    (kl, loss, grads), (got_kl, got_loss, got_grads) = results
    torch.testing.assert_close(got_kl, kl, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert got_grads.keys() == grads.keys() and any(".indexer." in name for name in grads)
    for name in grads:
        assert _rel(got_grads[name], grads[name]) <= 2e-6, name


@pytest.mark.parametrize("wrap", ["selective", "full", "compiled"])
def test_checkpointed_and_compiled_layers_equal_plain_ones(wrap):
    """Selective activation checkpointing keeps the ops' outputs (`parallelize.py`), full recomputes
    them, and torch.compile traces them as opaque ops (their fake kernels): the same loss and
    gradients as the plain model, to fp32 rounding (recomputation and compiled kernels reorder sums)."""
    args = get_preset("tiny").replace(index_topk=TOPK)
    x = torch.randint(0, 4000, (2, 40), generator=torch.Generator().manual_seed(0))
    results = []
    for wrapped in (False, True):
        model = build_model(args, attention_backend="absorbed", seed=0)
        if wrapped and wrap == "compiled":
            for layer in model.model.layers[:2]:  # a full-indexer layer and a shared one
                layer.compile(backend="aot_eager", fullgraph=True)
        elif wrapped:
            apply_activation_checkpointing(model, wrap, keep_matmul_min_k=32)
        out = model(x, MicroBatch(x, targets=torch.roll(x, -1, 1)))
        out.loss_sum.backward()
        results.append((out.loss_sum.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (got_loss, got_grads) = results
    assert abs(got_loss - loss) <= 1e-6 * abs(loss) and got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert _rel(got_grads[name], grad) <= 1e-5, name
