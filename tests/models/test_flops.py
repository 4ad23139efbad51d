"""The one model-FLOPs formula (trainer and benchmarks): closed-form attended keys equal the per-query sum."""

from __future__ import annotations

import random

import pytest

from glmtune.models.glm5 import get_preset
from glmtune.kernels.device_peaks import peak_tflops
from glmtune.models.glm5.flops import attended_keys, attention_flops_forward, flops_per_token


def test_attended_keys_in_closed_form_is_the_per_query_sum():
    for length in (1, 5, 255, 256, 257, 4096):
        for topk in (1, 256, 2048):
            assert attended_keys(length, topk) == sum(min(i + 1, topk) for i in range(length))


def test_attention_flops_follow_the_documents():
    args = get_preset("glm5")
    rng = random.Random(0)
    lengths = [rng.randint(1, 9000) for _ in range(20)]
    mean_keys = sum(min(i + 1, args.index_topk) for n in lengths for i in range(n)) / sum(lengths)
    per_key = 2 * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * args.num_hidden_layers
    assert attention_flops_forward(args, args.num_hidden_layers, lengths) == pytest.approx(per_key * mean_keys)
    # packing short documents lowers the attention share, never the matmul share
    one, packed = flops_per_token(args, 78, 3, [4096]), flops_per_token(args, 78, 3, [1024] * 4)
    assert packed < one
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("cpu") is None
