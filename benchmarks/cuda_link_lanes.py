"""The link emulator's CUDA lanes on this machine's GPU (glmtune/distributed/link_emulator.py):

1. a synchronous all-gather on emulated links takes its modeled time on the caller's stream;
2. a matrix-product loop issued after an asynchronous one hides it (the step takes about the
   larger of the two, not their sum);
3. two collectives on one group take their sum; on two groups, about the larger.

Prints one JSON line: modeled and measured seconds per case (CUDA events on the caller's stream).

    PYTHONPATH=. python benchmarks/cuda_link_lanes.py
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from glmtune.distributed.link_emulator import emulated_links
from glmtune.distributed.link_model import Links, bytes_sent
from glmtune.distributed.loopback import join_loopback_world


def _timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    shard = torch.ones(1 << 20, device=device)  # 4 MiB
    output = torch.empty(8 << 20, device=device)
    modeled = 0.2
    links = Links(nvlink_gbps=bytes_sent("all_gather", output.numel() * 4, 8) / modeled / 1e9, latency_us=0.0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    one_matmul = _timed(lambda: matmuls(20)) / 20
    n_hide = max(1, round(modeled / one_matmul))
    results = {"modeled_s": modeled, "matmul_s": one_matmul, "matmuls": n_hide}
    with join_loopback_world(0, 8):
        with emulated_links(links, device) as emulator:
            results["sync_all_gather_s"] = _timed(lambda: dist.all_gather_into_tensor(output, shard))
            results["copied"] = bool(torch.equal(output, torch.ones_like(output)))
            results["matmuls_alone_s"] = _timed(lambda: matmuls(n_hide))

            def hidden() -> None:
                work = dist.all_gather_into_tensor(output, shard, async_op=True)
                matmuls(n_hide)
                work.wait()
            results["all_gather_beside_matmuls_s"] = _timed(hidden)
            other = dist.new_group(list(range(8)))

            def two(groups) -> None:
                works = [dist.all_gather_into_tensor(output, shard, async_op=True, group=g) for g in groups]
                for work in works:
                    work.wait()
            results["two_on_one_group_s"] = _timed(lambda: two([dist.group.WORLD, dist.group.WORLD]))
            results["two_on_two_groups_s"] = _timed(lambda: two([dist.group.WORLD, other]))
            results["spin_cycles_per_s"] = emulator._rate
    print(json.dumps(results))


if __name__ == "__main__":
    main()
