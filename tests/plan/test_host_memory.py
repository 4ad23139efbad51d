"""`glmtune plan --measure` on a CPU checks the rank against the host's *available* memory
(MemAvailable: free plus the cache the kernel drops), not its free memory; `--headroom-gib` is
checked against the memory it would sit in (each targeted GPU, or the measured device), and with
--measure it takes effect in that check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import glmtune.plan.measure as measure
from glmtune.cli import main
from glmtune.cli.plan_cmd import _device_memory
from glmtune.config import load_config
from glmtune.plan.measure import check_device_holds, host_available_bytes

GIB = 2**30
# A busy host: nearly nothing free, 13.4 GiB available once the page cache is dropped.
MEMINFO = """MemTotal:       16384000 kB
MemFree:          104857 kB
MemAvailable:   14050918 kB
Buffers:          204800 kB
Cached:         12288000 kB
"""
SHORT = ["--data.packed_sequence_size", "256", "--train.generate_samples", "0", "--optim.warmup_steps", "0"]


@pytest.fixture
def busy_host(tmp_path, monkeypatch):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    monkeypatch.setattr(measure, "MEMINFO", path)
    return path


def _plan(peak_gib: float):
    return SimpleNamespace(rank=0, peak=SimpleNamespace(total=int(peak_gib * GIB), name="step 1 backward"))


def test_the_host_memory_is_what_is_available_not_what_is_free(busy_host, tmp_path):
    assert host_available_bytes() == 14050918 * 1024
    (tmp_path / "old").write_text("MemTotal: 1 kB\nMemFree: 1 kB\n")  # a kernel before 3.14: not said
    assert host_available_bytes(tmp_path / "old") is None and host_available_bytes(tmp_path / "none") is None
    # What --measure checks a CPU rank against: 13.4 GiB, so a 0.2 GiB rank is measured.
    available, name = _device_memory(load_config("tiny/sft_support_json", ["--train.device", "cpu"]))
    assert (available, name) == (14050918 * 1024, "CPU (available memory)")
    check_device_holds(_plan(0.2), available, name)
    with pytest.raises(ValueError, match=r"rank 0 plans 20\.0 GiB at its peak \(step 1 backward\); this CPU "
                                         r"\(available memory\) has 13\.4 GiB"):
        check_device_holds(_plan(20), available, name)


def test_a_headroom_given_to_measure_counts_in_the_check(busy_host):
    available = host_available_bytes()
    check_device_holds(_plan(0.2), available, "CPU", context_gib=13.0)
    with pytest.raises(ValueError, match=r"plans 0\.2 GiB .* \+ the headroom given \(--headroom-gib 13\.3, "
                                         r"--fragmentation 0\) = 13\.5 GiB; this CPU has 13\.4 GiB"):
        check_device_holds(_plan(0.2), available, "CPU", context_gib=13.3)
    with pytest.raises(ValueError, match=r"^--headroom-gib 1e\+30 is not below what this CPU has 13\.4 GiB"):
        check_device_holds(_plan(0.2), available, "CPU", context_gib=1e30)


@pytest.mark.parametrize(("argv", "message"), [
    (["--headroom-gib", "1e30"], "--headroom-gib 1e+30 is not below the h100-80g's 79.2 GiB of memory"),
    (["--headroom-gib", "100"], "--headroom-gib 100 is not below the h100-80g's 79.2 GiB"),
    (["--headroom-gib", "141", "--gpu", "h200-141g"], "--headroom-gib 141 is not below the h200-141g's 140.4 GiB"),
    (["--headroom-gib", "-1"], "--headroom-gib must be a finite number >= 0, got -1.0"),
    (["--headroom-gib", "inf"], "--headroom-gib must be a finite number >= 0, got inf"),
    (["--headroom-gib", "nan"], "--headroom-gib must be a finite number >= 0, got nan"),
    (["--measure", "--headroom-gib", "1e30"], "--headroom-gib 1e+30 is not below what this CPU (available memory) "
                                              "has 13.4 GiB"),
])
def test_a_headroom_no_memory_could_hold_is_refused(argv, message, busy_host, capsys):
    assert main(["plan", "tiny/sft_support_json", "--no-data", *argv, *SHORT]
                if "--measure" not in argv else ["plan", "tiny/sft_support_json", *argv, *SHORT]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_headroom_one_gpu_holds_plans_on_it(capsys):
    assert main(["plan", "tiny/sft_support_json", "--no-data", "--headroom-gib", "100", "--gpu", "h200-141g",
                 "--json", *SHORT]) == 0
    assert '"context_gib": 100.0' in capsys.readouterr().out
