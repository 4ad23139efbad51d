"""The plan's activation terms for the absorbed attention backends (`memory_activations.absorbed_saved`)
against what autograd actually saves in an MLA layer's forward with `attention_backend: absorbed`
(bf16, tiny widths; the fused backend's op saves the same tensors: q, c, indices, validity, out, lse).

Counted: every distinct storage a saved tensor lives in, but the layer's parameters and its input
(the decoder layer's input norm and input are the formula's, outside MLAttention). The formula
leaves out the rope's cos/sin halves both attention forms keep ([S, rope / 2] each, bf16): the
only difference allowed."""

import torch

from glmtune.models.common.document_masks import allowed_mask
from glmtune.models.common.memory_model import StepShape
from glmtune.models.common.rope import RotaryEmbedding
from glmtune.models.glm5 import memory_activations as act
from glmtune.models.glm5.args import get_preset
from glmtune.models.glm5.attention import MLAttention

ARGS = get_preset("tiny").replace(index_topk=16)


def _saved_bytes(seq: int) -> int:
    torch.manual_seed(0)
    layer = MLAttention(ARGS, has_indexer=False, backend="absorbed").bfloat16()
    x = torch.randn(1, seq, ARGS.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq).unsqueeze(0)
    rope = RotaryEmbedding(ARGS.rope_parameters, ARGS.qk_rope_head_dim, ARGS.max_position_embeddings)
    cos, sin = rope(positions, torch.bfloat16)
    allowed = allowed_mask(1, seq, x.device, positions)
    scores = torch.rand(allowed.shape, generator=torch.Generator().manual_seed(0)).masked_fill(~allowed, -1)
    selected = allowed & torch.zeros_like(allowed).scatter(-1, scores.topk(ARGS.index_topk, dim=-1).indices, True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, allowed, (selected, False), True, True, None)
    outside = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in outside)


def test_absorbed_terms_are_what_the_layer_saves():
    seq, e = 64, 2
    mb = StepShape(1, seq, absorbed_attention=True)
    parts = act.attention_saved(ARGS, mb, 0, e, act.Trainability())
    input_norm = act.norm_saved(seq, ARGS.hidden_size, e, True)
    formula = sum(parts.values()) - input_norm - e * seq * ARGS.hidden_size - parts["top-k mask"]
    rope_halves = e * seq * ARGS.qk_rope_head_dim
    assert _saved_bytes(seq) == formula + rope_halves
    assert "kv_b output (values)" not in parts and parts["selected key indices"] == 9 * seq * ARGS.index_topk
