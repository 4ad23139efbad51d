"""Dense bf16 tensor-core peaks of the GPUs glmtune knows, for MFU and the planner's costs."""

from __future__ import annotations

# Dense bf16 tensor-core peak (TFLOP/s) by GPU name; None elsewhere.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "A100": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named like torch.cuda.get_device_name() ("NVIDIA H200")."""
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device_name), None)
