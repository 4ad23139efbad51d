"""The kinds of work a profiled step's kernels are counted under (`step_profile.py`, `profile_sources.py`).

Matched by kernel name (operator name on a CPU), first match wins: an estimate that names what it
counted, not an exact attribution (a fused kernel counts once, in its first kind).
"""

from __future__ import annotations

import re

# (kind, kernel or operator name pattern), first match wins: attention before GEMM (cuDNN's attention
# kernels' names carry the architecture, sm90_, as CUTLASS GEMMs' do), copies before elementwise.
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated|dot_product|sparse_mla", re.IGNORECASE)),
    ("gemm", re.compile(r"gemm|matmul|\bmm\b|aten::(?:a?mm|bmm|addmm|linear|_scaled_mm|_grouped_mm)|"
                        r"cutlass|xmma|nvjet|sm90_|wgmma|cublas", re.IGNORECASE)),
    ("copy, gather, concat", re.compile(r"copy|memcpy|memset|cat|gather|scatter|index|transpose|contiguous|"
                                        r"clone|to_copy|fill", re.IGNORECASE)),
    ("elementwise and other", re.compile(r".")),
)


def kind_of(name: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(name))
