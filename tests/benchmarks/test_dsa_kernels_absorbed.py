"""`benchmarks/dsa_kernels.py --only absorbed` at tiny dims on CPU: the module imports without a GPU,
its cases are the queries they claim (one document; a cp-8 head_tail rank's two pieces), and the
absorbed backend's output and gradients (q, latent, k_rot, kv_b weight) equal sdpa's (fp32)."""

import torch

from benchmarks.dsa_kernels import ABSORBED_CASES, check_absorbed, layer_case, topk_selection
from glmtune.models.glm5.args import get_preset


def test_cases_are_the_ranks_queries():
    positions, keys, shard = layer_case("cp8_rank1", 16, "cpu")
    assert shard.pieces(128) == [(8, 8), (112, 8)] and keys == 120
    assert torch.equal(positions, torch.cat([torch.arange(8, 16), torch.arange(112, 120)]))
    sparse = topk_selection(positions, keys, 12, torch.Generator().manual_seed(0))
    assert sparse.sum(-1).tolist() == [[min(int(p) + 1, 12) for p in positions]]
    assert not (sparse[0] & (torch.arange(keys) > positions.unsqueeze(-1))).any()  # causal


def test_absorbed_case_runs_and_matches_sdpa_on_cpu():
    args = get_preset("tiny").replace(index_topk=12)
    lines = check_absorbed(16, args, "cpu", ("sdpa", "triton", "absorbed"), torch.float32)
    assert [line["case"] for line in lines] == list(ABSORBED_CASES)
    for line in lines:
        assert line["absorbed"]["fwd_bwd_ms"] > 0 and line["absorbed"]["out_rel_diff"] <= 1e-5
        assert max(line["absorbed"]["grad_rel_diff_q_latent_krot_kvb"]) <= 1e-5
        assert isinstance(line["triton"], (str, dict))  # a string where this machine has no Triton GPU path
