"""The fused expert low-rank add (`glmtune/kernels/lowrank_add.py`) against its torch
reference: values and gradients for uneven expert groups (an empty expert, groups that
end mid-tile, more tiles than rows of one expert), a rank that is not a power of two.

Runs in Triton's CPU interpreter in a child process (fp32); bf16 on the GPU is covered by
benchmarks/throughput.py --lora, which compares losses with transformers + PEFT.
"""

import pytest
import torch
from triton_interpreter import main, run_checks_in_interpreter

pytest.importorskip("triton")


def _inputs(counts, out_dim, rank, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = int(sum(counts))
    return (torch.randn(rows, out_dim, generator=gen), torch.randn(rows, rank, generator=gen),
            torch.randn(len(counts), out_dim, rank, generator=gen), torch.tensor(counts))


def check_fused_matches_reference():
    from glmtune.kernels.lowrank_add import lowrank_grouped_add

    for counts, out_dim, rank in (([70, 0, 3, 129], 200, 24), ([1], 128, 32), ([0, 0, 5], 7, 16)):
        base, h, b, counts_E = _inputs(counts, out_dim, rank)
        results = []
        for backend in ("torch", "triton"):
            leaves = [t.clone().requires_grad_() for t in (base, h, b)]
            out = lowrank_grouped_add(*leaves, counts_E, backend)
            upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            (out * upstream).sum().backward()
            results.append([out.detach()] + [t.grad for t in leaves])
        for mine, reference in zip(*results[::-1]):
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-4)
        expected = base.clone()
        start = 0
        for expert, n in enumerate(counts):
            expected[start:start + n] += h[start:start + n] @ b[expert].T
            start += n
        torch.testing.assert_close(results[1][0], expected, rtol=1e-5, atol=1e-4)


def check_expert_lora_matches_unfused():
    """The experts' LoRA with fused sums (triton; torch: a grouped GEMM and an add inside the same
    autograd function) equals autograd through the plain per-expert products (the loop backend)."""
    import copy

    from glmtune.models.glm5.moe import GroupedExperts
    from glmtune.peft.lora import LoRAGroupedExperts, LoraSpec

    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 16)
    experts.reset_parameters(0.2)
    looped = copy.deepcopy(experts)
    looped.backend = "loop"
    counts = torch.tensor([9, 0, 14, 7])
    x = torch.randn(int(counts.sum()), 32)
    grads = []
    for kernel, base in (("triton", experts), ("torch", experts), ("torch", looped)):
        lora = LoRAGroupedExperts.from_experts(copy.deepcopy(base), LoraSpec(8, 16, kernel=kernel),
                                               ("gate_up_proj", "down_proj"))
        with torch.no_grad():
            for name, p in lora.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
        lora.gate_up_proj.requires_grad_(False)
        lora.down_proj.requires_grad_(False)
        xi = x.clone().requires_grad_()
        assert lora._fused(xi) == (base is experts)
        out = lora(xi, counts)
        out.square().sum().backward()
        grads.append([out.detach(), xi.grad] + [p.grad for n, p in lora.named_parameters() if "lora_" in n])
    for fused in grads[:2]:
        assert len(fused) == 6
        for mine, reference in zip(fused, grads[2]):
            # fp32 sums over rows in another order (grouped GEMM vs per-expert products): the
            # adapters' gradients (|g| ~ 15) differ by up to ~2e-4, as in the check above.
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
    main(check_fused_matches_reference, check_expert_lora_matches_unfused)


def test_lowrank_add_in_interpreter():
    assert run_checks_in_interpreter(__file__) == ["check_fused_matches_reference",
                                                   "check_expert_lora_matches_unfused"]
