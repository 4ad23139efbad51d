"""GPUs a plan can target: usable memory, dense bf16 peak, and the headroom a run leaves free.

Memory is what `torch.cuda.mem_get_info` reports as total on an idle device (the marketing
figure is decimal gigabytes): an H200 "141 GB" shows 140.4 GiB, an H100 "80 GB" 79.2 GiB.
Headroom is what the planned peak (allocator-counted tensors) must leave for everything the
allocator does not count or cannot hand out: the CUDA context and cuBLAS/NCCL workspaces
(`context_gib`) and fragmentation of the caching allocator (`fragmentation`, a share of the
peak). Both are settings (`glmtune plan --headroom-gib --fragmentation`), stated in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmtune.kernels.device_peaks import PEAK_BF16_TFLOPS


@dataclass(frozen=True)
class GpuSpec:
    key: str  # the --gpu name
    name: str  # as torch.cuda.get_device_name() spells it
    memory_gib: float
    bf16_tflops: float

    def usable_gib(self, peak_gib: float, context_gib: float, fragmentation: float) -> float:
        """What is left after a run whose allocator peak is `peak_gib` (negative: does not fit)."""
        return self.memory_gib - context_gib - peak_gib * (1 + fragmentation)


GPUS = {spec.key: spec for spec in (
    GpuSpec("h100-80g", "NVIDIA H100 80GB HBM3", 79.2, PEAK_BF16_TFLOPS["H100"]),
    GpuSpec("h200-141g", "NVIDIA H200", 140.4, PEAK_BF16_TFLOPS["H200"]),
    GpuSpec("b200-180g", "NVIDIA B200", 178.4, PEAK_BF16_TFLOPS["B200"]),
    GpuSpec("a100-80g", "NVIDIA A100-SXM4-80GB", 79.2, PEAK_BF16_TFLOPS["A100"]),
)}


def gpu_spec(key: str) -> GpuSpec:
    if key not in GPUS:
        raise ValueError(f"--gpu {key!r} unknown; choose from {', '.join(GPUS)}")
    return GPUS[key]


def spec_for_device_name(name: str) -> GpuSpec | None:
    """The catalogue entry a measured run's GPU name belongs to ("NVIDIA H200" -> h200-141g)."""
    return next((spec for spec in GPUS.values() if spec.key.split("-")[0].upper() in name.upper()), None)
