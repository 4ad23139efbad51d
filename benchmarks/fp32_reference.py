"""Which side moves float32 logits on a CUDA GPU (preflight check 8's reference, docs/preflight.md):
transformers and glmtune on the tiny preset's bf16 weights, each loaded in float32 (or loaded in
bf16 and upcast in place), on the CPU and on the GPU, and glmtune with every attention, indexer,
MoE dispatch and expert GEMM backend; relative error (Frobenius) and top-1 agreement printed.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/fp32_reference.py
"""
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from glmtune import load_pretrained, save_pretrained  # noqa: E402
from glmtune.models.glm5 import build_model, get_preset  # noqa: E402
from glmtune.models.glm5.moe import set_moe_dispatch_backend  # noqa: E402


def rel(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return f"{((a - b).norm() / b.norm()).item():.3e} top1 {(a.argmax(-1) == b.argmax(-1)).float().mean().item():.3f}"


def transformers_side(export: str, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits on the CPU (returned), beside its GPU runs: loaded in float32,
    and loaded in bf16 then upcast in place."""
    from transformers import AutoModelForCausalLM

    hf_cpu = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, attn_implementation="eager").eval()
    t_cpu = hf_cpu(ids).logits
    print("transformers cuda vs cpu", rel(hf_cpu.cuda()(ids.cuda()).logits, t_cpu))
    hf_b = AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
    hf_b.float()
    print("transformers cuda bf16-loaded .float() vs cpu", rel(hf_b(ids.cuda()).logits, t_cpu))
    return t_cpu


def glmtune_side(export: str, ids: torch.Tensor, t_cpu: torch.Tensor) -> None:
    """glmtune's float32 logits on the GPU with every backend, against its CPU run and transformers'."""
    g_cpu = load_pretrained(export, torch.float32, "cpu", attention_backend="eager").eval()
    set_moe_dispatch_backend(g_cpu, "torch")
    l_cpu = g_cpu(ids).logits
    print("glmtune cpu vs transformers cpu", rel(l_cpu, t_cpu))
    for att, idx, disp, moe in itertools.product(("eager", "sdpa", "auto"), ("reference", "auto"), ("torch", "triton"),
                                                 ("loop", "grouped_mm")):
        g = load_pretrained(export, torch.float32, "cuda", attention_backend=att, moe_backend=moe,
                            indexer_backend=idx).eval()
        set_moe_dispatch_backend(g, disp)
        logits = g(ids.cuda()).logits
        print(f"glmtune cuda att={att} idx={idx} disp={disp} moe={moe} vs glmtune cpu", rel(logits, l_cpu),
              "| vs transformers cpu", rel(logits, t_cpu))
    g = load_pretrained(export, torch.bfloat16, "cuda").eval()
    g.float()
    print("glmtune cuda bf16-loaded .float() (defaults) vs transformers cpu", rel(g(ids.cuda()).logits, t_cpu))


@torch.no_grad()
def main() -> None:
    print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(),
          "cudnn", torch.backends.cudnn.allow_tf32)
    args = get_preset("tiny")
    ids = torch.randint(0, args.vocab_size, (1, min(256, args.index_topk)), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as export:
        save_pretrained(build_model(args, torch.bfloat16, "cpu", seed=0), export)
        glmtune_side(export, ids, transformers_side(export, ids))


if __name__ == "__main__":
    main()
