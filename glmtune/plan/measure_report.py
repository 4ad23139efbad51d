"""`glmtune plan --measure`'s answer: the measured rank beside the plan for that rank, as one
JSON-ready dict (one line of it is a `--throughput` source: `tflops`, `gpu`, `impl`) and as
rich tables.

Throughput counts the model FLOPs of the family's one formula (`flops_per_token`: matmuls and
attention over each document's own length, forward + backward = 3 x forward, the DSA indexer
and top-k attention at their sparse cost), so TFLOP/s here and in `glmtune train`'s log are the
same quantity; published figures that count sparse attention densely read higher.
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from glmtune.config import JobConfig, pipeline_microbatches
from glmtune.distributed.mesh import ParallelMesh
from glmtune.plan.comm import (
    Links,
    bubble_fraction,
    estimated_step,
    group_traffic,
    with_bubble,
)
from glmtune.plan.measure import RankMeasurement
from glmtune.plan.memory import MemoryPlan, describe

GIB = 2**30


def _ratio(measured: float | None, planned: float) -> float | None:
    return measured / planned if measured is not None and planned else None


def _before_own_work(name: str, parts: dict[str, int]) -> int:
    """A planned phase without what its layer allocates once its backward has begun (its
    recomputation and scratch, the MoE buffers, FSDP's gathered and unsharded transients)."""
    layer = name.removesuffix(" backward") + ":"
    return sum(v for k, v in parts.items() if not k.startswith((layer, "FSDP:", "MoE all-to-all")))


def phase_rows(plan: MemoryPlan, measured: dict[str, int]) -> list[dict[str, Any]]:
    """The plan's phases that were measured: planned total, planned before the phase's own work,
    measured at its start."""
    return [{"phase": ph.name, "planned_bytes": ph.total, "planned_at_start_bytes": _before_own_work(ph.name, ph.parts),
             "measured_at_start_bytes": measured[ph.name]} for ph in plan.phases if ph.name in measured]


def measure_report(cfg: JobConfig, recipe: str, m: RankMeasurement, plan: MemoryPlan, links: Links) -> dict[str, Any]:
    d = m.degrees
    step = m.step
    traffic = [t for axes, g in m.comm_bytes.items()
               for t in group_traffic(axes, g["ranks"], g["bytes"], links, g.get("calls"))]
    p = cfg.parallel
    bubble = bubble_fraction(p.pp_schedule, d.pp, pipeline_microbatches(cfg), p.pp_stages_per_rank,
                             ParallelMesh(d, rank=m.rank).rank("pp"), p.activation_checkpointing)
    estimate = estimated_step(step.total, traffic, bubble)
    seq, flops_per_token = cfg.data.packed_sequence_size, m.flops_per_token
    tokens_per_gpu_step = cfg.train.global_batch_size * seq / d.world_size
    emulated = emulated_figures(m, bubble, step.total)
    per_gpu = tokens_per_gpu_step / (emulated["step_s"] if emulated else estimate["step_s"])
    device_name = torch.cuda.get_device_name() if m.device.startswith("cuda") else "cpu"
    held = {k: m.held.get(k, 0) for k in ("params", "grads", "optimizer")}
    planned_held = {"params": plan.state.params, "grads": plan.state.grads, "optimizer": plan.state.optimizer}
    return {
        "recipe": recipe, "rank": m.rank, "layout": d.describe(), "device": device_name, "gpu": device_name,
        "impl": "glmtune plan --measure",
        "memory": {
            "held": held, "planned_held": planned_held,
            "state_allocated_bytes": m.state_bytes,
            "peak_bytes": m.peak_bytes, "planned_peak_bytes": plan.peak.total, "planned_peak_phase": plan.peak.name,
            "peak_ratio": _ratio(m.peak_bytes, plan.peak.total),
            "planned_peak_parts": dict(describe(plan)),
            "phases": phase_rows(plan, m.phase_starts),
        },
        "time": {
            "micro_batches": m.micro_batches, "tokens_per_micro_batch": m.tokens_per_micro_batch,
            "forward_s": step.forward, "backward_s": step.backward, "optimizer_s": step.optimizer,
            "step_s": step.total, "per_micro_batch_s": (step.total - step.optimizer) / m.micro_batches,
            "pipelined": d.pp > 1,
            "steps_timed": len(m.steps), "losses": m.losses, "auxiliary_losses": m.auxiliary_losses,
        },
        "comm": [{"axes": t.axes, "op": t.op, "ranks": len(t.ranks), "link": t.link, "bytes": t.bytes_received,
                  "seconds": t.seconds, "overlapped": t.overlapped} for t in traffic],
        "links": {"nvlink_gbps": links.nvlink_gbps, "fabric_gbps": links.fabric_gbps,
                  "gpus_per_node": links.gpus_per_node, "latency_us": links.latency_us},
        "estimate": estimate,
        "emulated": emulated,  # None unless --emulate-links; then tokens/s below come from it
        "tokens_per_s_source": "emulated links" if emulated else "estimate",
        "tokens_per_s_per_gpu": per_gpu,
        # what no schedule can beat with these links (`link_floor`); None without --emulate-links
        "floor_tokens_per_s_per_gpu": tokens_per_gpu_step / emulated["floor_s"] if emulated else None,
        "tokens_per_s_per_node": per_gpu * links.gpus_per_node,
        "flops_per_token": flops_per_token,
        "tflops": per_gpu * flops_per_token / 1e12,
        "compute_tflops": tokens_per_gpu_step * flops_per_token / step.total / 1e12,
    }


def emulated_figures(m: RankMeasurement, bubble: float, compute_s: float) -> dict[str, Any] | None:
    """The emulated steps' mean: the measured step with the links' time felt, its exposed part (the
    step beyond the compute steps'), each lane's modeled seconds, and the step with the pipeline
    bubble (not felt by one rank whose receives arrive at once) added as the estimate adds it."""
    step = m.emulated_step
    if step is None:
        return None
    floor_s, floor_bound = link_floor(compute_s, m.lane_seconds)
    return {"measured_step_s": step.total, "exposed_comm_s": max(0.0, step.total - compute_s),
            "bubble_fraction": bubble, "step_s": with_bubble(step.total, bubble),
            "lane_seconds": m.lane_seconds, "steps_timed": len(m.emulated_steps),
            "floor_s": with_bubble(floor_s, bubble), "floor_bound": floor_bound}


def link_floor(compute_s: float, lane_seconds: dict[str, dict[str, float]]) -> tuple[float, str]:
    """The shortest step these links allow, every transfer hidden, and what bounds it: "compute", or
    the axes of the busiest lane. A lane runs its group's collectives one after another and lanes
    run side by side (`link_emulator.py`), so no schedule makes the step shorter than the compute or
    than the busiest lane's modeled seconds, whichever is longer."""
    busiest = max(((sum(ops.values()), axes) for axes, ops in lane_seconds.items()), default=(0.0, ""))
    return (compute_s, "compute") if busiest[0] <= compute_s else busiest


def _bound_words(bound: str) -> str:
    return "the compute" if bound == "compute" else f"the {bound} lane"


def _unit(report: dict[str, Any]) -> tuple[str, int]:
    """GiB, or MiB for a model whose rank plans under 1 GiB (the tiny preset)."""
    return ("GiB", GIB) if report["memory"]["planned_peak_bytes"] >= GIB else ("MiB", 2**20)


def _size(nbytes: float | None, unit: int) -> str:
    return "-" if nbytes is None else f"{nbytes / unit:.2f}"


def print_measure(report: dict[str, Any], console: Console) -> None:
    """Print `measure_report`'s answer: memory, the plan's largest phases, the step's compute and its
    transfers as tables, then the step on the cluster and the throughput."""
    mem, time, est = report["memory"], report["time"], report["estimate"]
    console.print(f"[bold]{report['recipe']}[/bold], rank {report['rank']} of {report['layout']}, measured on "
                  f"{report['device']}")
    name, unit = _unit(report)
    console.print(_memory_table(mem, name, unit))
    by_phase = _phases_table(mem, name, unit)
    if by_phase is not None:
        console.print(by_phase)
    console.print(_compute_table(time))
    console.print(_transfers_table(report["comm"]))
    _print_step_and_throughput(report, est, console)


def _memory_table(mem: dict[str, Any], name: str, unit: int) -> Table:
    """The rank's state, its memory held between steps and its peak: planned beside measured."""
    table = Table(title=f"Memory: planned and measured ({name})", title_justify="left")
    for column in ("", "planned", "measured", "measured / planned"):
        table.add_column(column, justify="left" if not column else "right")
    for key in ("params", "grads", "optimizer"):
        planned, measured = mem["planned_held"][key], mem["held"][key]
        table.add_row(key, _size(planned, unit), _size(measured, unit), f"{measured / planned:.3f}" if planned else "-")
    table.add_row("held between steps (allocator)", "", _size(mem["state_allocated_bytes"], unit), "")
    ratio = f"{mem['peak_ratio']:.3f}" if mem["peak_ratio"] is not None else "-"
    table.add_row(f"[bold]peak[/bold] (plan: {mem['planned_peak_phase']})", _size(mem["planned_peak_bytes"], unit),
                  _size(mem["peak_bytes"], unit), ratio)
    return table


def _phases_table(mem: dict[str, Any], name: str, unit: int) -> Table | None:
    """The six largest planned phases that were measured; None when none was (on a CPU)."""
    phases = sorted(mem["phases"], key=lambda row: -row["planned_bytes"])[:6]
    if not phases:
        return None
    by_phase = Table(title=f"The plan's largest phases: planned, and allocated when the phase began ({name})",
                     title_justify="left")
    for column in ("phase", "planned", "planned at its start", "measured at its start"):
        by_phase.add_column(column, justify="left" if column == "phase" else "right")
    for row in phases:
        by_phase.add_row(row["phase"], _size(row["planned_bytes"], unit), _size(row["planned_at_start_bytes"], unit),
                         _size(row["measured_at_start_bytes"], unit))
    return by_phase


def _compute_table(time: dict[str, Any]) -> Table:
    """The seconds of one step's compute on this rank, by part."""
    times = Table(title=f"Compute of one step on this rank ({time['micro_batches']} micro-batches of "
                        f"{time['tokens_per_micro_batch']:,} tokens; mean of {time['steps_timed']} steps)",
                  title_justify="left")
    times.add_column("")
    times.add_column("seconds", justify="right")
    rows = [("forward (all micro-batches)", "forward_s"), ("backward", "backward_s")]
    if time["forward_s"] is None:  # a pipeline's schedule, or a family whose loss runs the model without its forward
        rows = [("forward + backward (the pipeline schedule)" if time.get("pipelined", True) else
                 "forward + backward (not split: the family's loss runs outside the model's forward)", "backward_s")]
    rows += [("optimizer (clip + step)", "optimizer_s"), ("per micro-batch, forward + backward", "per_micro_batch_s"),
             ("step", "step_s")]
    for label, key in rows:
        times.add_row(label, f"{time[key]:.3f}")
    return times


def _transfers_table(transfers: list[dict[str, Any]]) -> Table:
    """The estimated transfers of a step, those of 1 MB or more."""
    comm = Table(title="Transfers per step, estimated (not timed here; under 1 MB left out)", title_justify="left")
    for column in ("group (mesh axes)", "collective", "ranks", "link", "GB received", "seconds", "hidden by compute"):
        comm.add_column(column, justify="right" if column in ("ranks", "GB received", "seconds") else "left")
    for t in transfers:
        if t["bytes"] >= 1e6:
            comm.add_row(t["axes"], t["op"], str(t["ranks"]), t["link"], f"{t['bytes'] / 1e9:.2f}",
                         f"{t['seconds']:.3f}", "yes" if t["overlapped"] else "no")
    return comm


def _print_step_and_throughput(report: dict[str, Any], est: dict[str, Any], console: Console) -> None:
    """The links assumed, the estimated step on the cluster (and the emulated one, when measured), and
    the tokens/s and TFLOP/s per GPU that follow."""
    links = report["links"]
    console.print(f"links: NVLink {links['nvlink_gbps']:g} GB/s, fabric {links['fabric_gbps']:g} GB/s per GPU, "
                  f"{links.get('latency_us', 0):g} us a message, {links['gpus_per_node']} GPUs a node; "
                  f"pipeline bubble {est['bubble_fraction']:.1%}")
    console.print(f"step on the cluster (estimate): {est['step_s']:.2f} s = compute {est['compute_s']:.2f} + "
                  f"exposed transfers {est['exposed_comm_s']:.2f} + FSDP beyond compute "
                  f"{est['fsdp_beyond_compute_s']:.2f}, then / (1 - bubble)")
    emulated = report.get("emulated")
    if emulated:
        lanes = ", ".join(f"{axes} {sum(ops.values()):.2f} s" for axes, ops in emulated["lane_seconds"].items()
                          if sum(ops.values()) >= 5e-4)
        console.print(f"step with emulated links (measured): {emulated['measured_step_s']:.2f} s = compute "
                      f"{est['compute_s']:.2f} + exposed {emulated['exposed_comm_s']:.2f}; then / (1 - bubble): "
                      f"{emulated['step_s']:.2f} s; links busy per step: {lanes or 'none'}")
        console.print(f"floor of these links (every transfer hidden, the bubble added): {emulated['floor_s']:.2f} s, "
                      f"bound by {_bound_words(emulated['floor_bound'])}: at most "
                      f"{report['floor_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")
    console.print(f"[bold]{report['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU[/bold] "
                  f"(from the {report.get('tokens_per_s_source', 'estimate')}) "
                  f"({report['tokens_per_s_per_node']:,.0f} per node), {report['tflops']:.1f} model TFLOP/s per GPU "
                  f"({report['compute_tflops']:.1f} over the compute alone; "
                  f"{report['flops_per_token'] / 1e9:.1f} GFLOP per token)")
