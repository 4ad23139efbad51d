"""Per-step losses and gradient norms that must not move by one bit: golden files.

A change that is not meant to change numerics (a renovation, a move, a rename) must keep
every run's per-step loss and gradient norm bit-identical. The equivalence tests in
tests/distributed compare each layout with one process to a tolerance; these compare five
runs exactly against what they printed when the files under tests/golden/ were recorded:
the tiny SFT and LoRA recipes for 20 steps in one process, and three multi-process
layouts of the equivalence tests (FSDP 2, EP 2 from an HF checkpoint, PP 2 with a stage
starting on a shared-indexer layer), sharing their runs.

A change that is meant to change numerics re-records them, saying so in its commit:
`GLMTUNE_RECORD_GOLDEN=1 python -m pytest tests/test_golden_losses.py`.

Bits depend on the kernels torch picks, so each file records the torch version, CPU
capability and CPU vendor it was made with; elsewhere (another torch, a CPU with other vector
units or of another vendor) the comparison is relative 1e-5, the equivalence tests' own bound.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed.test_expert_parallel_train import from_hf_checkpoint, tiny_hf_checkpoint
from tests.train.run_helpers import WITH_EXPORT, WITH_VALIDATION, shared_run, step_records

GOLDEN = Path(__file__).parent / "golden"
TWENTY_STEPS = ["--train.max_steps", "20", "--checkpoint.every_steps", "10"]


def _runs(shared_results) -> dict:
    """name -> a thunk giving the run (only the one a test asks for is made)."""
    return {
        "sft_20_steps": lambda: shared_run(shared_results, *TWENTY_STEPS),
        "lora_20_steps": lambda: shared_run(shared_results, *TWENTY_STEPS, recipe="tiny/lora_support_json"),
        # tests/distributed/test_fsdp_train.py's two-process run
        "fsdp2": lambda: shared_run(shared_results, *WITH_EXPORT, "--nproc-per-node", "2"),
        # tests/distributed/test_expert_parallel_train.py's (and test_sharded_load_train.py's) run
        "ep2_from_hf": lambda: shared_run(shared_results, *from_hf_checkpoint(tiny_hf_checkpoint(shared_results)),
                                          "--parallel.ep", "2", nproc=2),
        # tests/distributed/test_pipeline_train.py's 1F1B-carry run
        "pp2_1f1b_carry": lambda: shared_run(shared_results, *WITH_VALIDATION, "--parallel.pp", "2",
                                             "--parallel.pp_layer_split", "[3,1]", nproc=2),
    }


NAMES = ["sft_20_steps", "lora_20_steps", "fsdp2", "ep2_from_hf", "pp2_1f1b_carry"]


@pytest.mark.parametrize("name", NAMES)
def test_per_step_losses_are_bit_identical_to_the_golden_file(name, shared_results):
    run = _runs(shared_results)[name]()
    records = step_records(run.run_dir, keys=("loss", "grad_norm", "val_loss"))
    actual = {str(step): list(values) for step, values in sorted(records.items())}
    path = GOLDEN / f"{name}.json"
    if os.environ.get("GLMTUNE_RECORD_GOLDEN") == "1":
        path.write_text(json.dumps({"recorded_with": _environment(), "steps": actual}, indent=1) + "\n")
    golden = json.loads(path.read_text())
    assert list(actual) == list(golden["steps"]), name
    exact = golden["recorded_with"] == _environment()
    for step, values in golden["steps"].items():  # float(repr(x)) == x: JSON keeps every bit of a double
        if exact:
            assert actual[step] == values, f"{name} step {step}: {actual[step]} != golden {values}"
        else:
            assert actual[step] == [None if v is None else pytest.approx(v, rel=1e-5) for v in values], step


def _environment() -> dict[str, str]:
    # The vendor too: the same torch and vector units pick other kernels (and roundings) on AMD and
    # Intel CPUs (2026-12-04: one ulp apart at step 1 between the two, every run).
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_vendor": _cpu_vendor()}


def _cpu_vendor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "unknown")
