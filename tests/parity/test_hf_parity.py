"""glmtune's GLM-5 against transformers' GlmMoeDsaForCausalLM (>= 5.17): logits, gradients,
checkpoint round trips, packed rows and bf16, on tiny random models of every style."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from glmtune import load_pretrained, save_pretrained
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.glm5.args import Glm5Args
from glmtune.models.glm5.model import build_model
from tests.parity.hf_reference import STYLES, make_hf_model

SEQ = 24  # > index_topk (8): the sparse mask selects a strict subset of keys


@pytest.fixture(scope="module", params=sorted(STYLES))
def pair(request, tmp_path_factory):
    style = request.param
    hf = make_hf_model(style)
    path = tmp_path_factory.mktemp(f"hf-{style}")
    hf.save_pretrained(path)
    ours = load_pretrained(path, dtype=torch.float32, attention_backend="eager", moe_backend="loop")
    return style, hf, ours, path


def _tokens(batch=2, seq=SEQ, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 512, (batch, seq), generator=gen)


def test_config_round_trip(pair):
    _, hf, ours, _ = pair
    assert ours.args.indexer_types == hf.config.indexer_types
    assert ours.args.mlp_layer_types == hf.config.mlp_layer_types
    has_indexer = [layer.self_attn.indexer is not None for layer in ours.model.layers]
    assert has_indexer == [t == "full" for t in hf.config.indexer_types]


@pytest.mark.parametrize("moe_backend", ["loop", "grouped_mm"])
def test_logits_match(pair, moe_backend):
    _, hf, ours, _ = pair
    for layer in ours.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.backend = moe_backend
    x = _tokens()
    with torch.no_grad():
        expected, actual = hf(x).logits, ours(x).logits
    assert actual.shape == (2, SEQ, 512)
    assert (expected - actual).abs().max().item() <= 1e-4


@pytest.mark.parametrize("seq", [6, SEQ])  # 6 <= top-k: the flash-eligible is_causal path
@pytest.mark.parametrize("query_block", [1024, 5])  # 5: the masked queries run in 4 key-trimmed blocks
def test_sdpa_backend_matches(pair, seq, query_block):
    _, hf, _, path = pair
    ours = load_pretrained(path, dtype=torch.float32, attention_backend="sdpa", moe_backend="grouped_mm")
    for layer in ours.model.layers:
        layer.self_attn.query_block = query_block
    x = _tokens(seed=3, seq=seq)
    with torch.no_grad():
        assert (hf(x).logits - ours(x).logits).abs().max().item() <= 1e-4
    # packed rows take the blocked masked path everywhere
    positions = torch.cat([torch.arange(seq // 2), torch.arange(seq - seq // 2)]).unsqueeze(0)
    with torch.no_grad():
        expected = hf(x, position_ids=positions, use_cache=False).logits
        assert (expected - ours(x, MicroBatch(x, positions)).logits).abs().max().item() <= 1e-4


def test_gradients_match(pair):
    _, hf, ours, _ = pair
    x = _tokens(seed=2)
    labels = torch.roll(x, -1, dims=1)
    for model in (hf, ours):
        model.zero_grad(set_to_none=True)
        logits = model(x).logits
        F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
    ours_params = dict(ours.named_parameters())
    trained = [(name, p) for name, p in hf.named_parameters() if p.grad is not None]
    assert len(trained) > 20
    for name, hf_param in trained:
        mine = ours_params[name]
        assert mine.grad is not None, f"{name}: transformers trains it, glmtune gave no gradient"
        ref = hf_param.grad
        rel = (mine.grad - ref).norm() / ref.norm().clamp_min(1e-12)
        assert rel.item() <= 1e-4, f"{name}: relative gradient error {rel.item():.2e}"
    # What transformers does not train (the frozen indexer) gets no gradient here either.
    untrained = {name for name, p in hf.named_parameters() if p.grad is None}
    assert untrained and all(".indexer." in n for n in untrained)
    assert all(ours_params[n].grad is None for n in untrained)


def test_ours_to_transformers_round_trip(pair, tmp_path):
    _, _, ours, _ = pair
    save_pretrained(ours, tmp_path / "out", max_shard_size=40_000)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                    dtype=torch.float32).eval()
    x = _tokens(seed=4)
    with torch.no_grad():
        assert (reloaded(x).logits - ours(x).logits).abs().max().item() <= 1e-5


def test_hf_dir_round_trip_is_bit_identical(pair, tmp_path):
    _, _, ours, path = pair
    save_pretrained(ours, tmp_path / "again")
    source = load_file(path / "model.safetensors")
    written = load_file(tmp_path / "again" / "model.safetensors")
    assert source.keys() == written.keys()
    for key, tensor in source.items():
        assert written[key].dtype == tensor.dtype, key
        assert torch.equal(written[key], tensor), key
    assert Glm5Args.from_hf_config(tmp_path / "again") == ours.args


def test_packed_row_equals_documents_alone(pair):
    _, hf, ours, _ = pair
    doc_a, doc_b = _tokens(1, 14, seed=5), _tokens(1, 19, seed=6)
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(14), torch.arange(19)]).unsqueeze(0)
    documents = torch.cat([torch.zeros(14), torch.ones(19)]).long().unsqueeze(0)
    with torch.no_grad():
        by_positions = ours(packed, MicroBatch(packed, positions)).logits
        by_documents = ours(packed, MicroBatch(packed, positions, documents)).logits
        alone_a, alone_b = hf(doc_a).logits, hf(doc_b).logits
        # transformers treats the row as packed only without a cache object (use_cache=False);
        # with its default use_cache=True the second document attends the first.
        hf_packed = hf(packed, position_ids=positions, use_cache=False).logits
    for logits in (by_positions, by_documents):
        assert (logits[:, :14] - alone_a).abs().max().item() <= 1e-4
        assert (logits[:, 14:] - alone_b).abs().max().item() <= 1e-4
        assert (logits - hf_packed).abs().max().item() <= 1e-4


def test_bf16_difference_is_bounded(pair, tmp_path):
    style, _, _, path = pair
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16).eval()
    ours = load_pretrained(path, dtype=torch.bfloat16, attention_backend="eager", moe_backend="grouped_mm")
    x = _tokens(seed=7)
    with torch.no_grad():
        expected, actual = hf(x).logits.float(), ours(x).logits.float()
    diff = (expected - actual).abs().max().item()
    scale = expected.abs().max().item()
    # Measured 0.0 on CPU (same ops, same order, sparse top-k included). Allow 2 bf16 ulps at
    # logit scale so a different BLAS build does not fail the suite; a real bug is far larger.
    assert diff <= 2 * 2**-8 * scale, f"{style}: bf16 max |diff| {diff} at logit scale {scale}"


def test_model_builds_on_meta_without_memory():
    from glmtune.models.glm5.args import get_preset

    model = build_model(get_preset("glm5.3"), dtype=torch.bfloat16, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.model.layers[3].mlp.gate.weight.dtype == torch.float32
