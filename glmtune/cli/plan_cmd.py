"""`glmtune plan RECIPE [--gpus N] [--gpu KIND ...] [--price-per-gpu-hour P] [--json]`.

Before a cluster is reserved: the model-state floor, the per-GPU memory of the recipe's
layout, whether it fits each GPU kind and the smallest GPU count that does, the tokens of
one epoch of the recipe's data, and the time and cost of the run from a measured speed
(`--throughput`). Nothing is allocated: the model is built on the meta device
(`glmtune/plan/`, docs/plan.md). Dotted overrides apply as in `glmtune train`. Every numeric
option is finite and in its range (`check_numbers`): a NaN price or a negative fragmentation
would otherwise print a plan that looks as trustworthy as any other.
"""

from __future__ import annotations

import argparse
import json
import math
from contextlib import nullcontext

from glmtune.cli.arg_types import RecipeOptions

_MAX_GPUS = 2048  # the fit search's default limit


def _add_options(parser: argparse.ArgumentParser) -> None:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.plan.hardware import GPUS

    parser.add_argument("--gpus", type=int, default=None,
                        help="plan the recipe's layout at N GPUs (its pp, cp and ep; dp_shard refilled)")
    parser.add_argument("--gpu", action="append", choices=sorted(GPUS), default=None,
                        help="GPU kind(s) to plan for (repeatable; default: h100-80g and h200-141g)")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, help="price of one GPU-hour")
    parser.add_argument("--throughput", default=None,
                        help="a measured run: RUN_DIR, its metrics.jsonl, or a benchmark's JSON lines")
    parser.add_argument("--tflops-per-gpu", type=float, default=None,
                        help="a measured model TFLOP/s per GPU, instead of --throughput")
    parser.add_argument("--measured-gpu", choices=sorted(GPUS), default=None,
                        help="the GPU --tflops-per-gpu was measured on (default: the planned one)")
    parser.add_argument("--epochs", type=float, default=None, help="plan this many epochs of the data "
                        "instead of train.max_steps")
    parser.add_argument("--write-gbps", type=float, default=1.0, help="checkpoint write GB/s per GPU")
    parser.add_argument("--restarts", type=int, default=None, help="restarts to budget (default: one a day)")
    parser.add_argument("--restart-minutes", type=float, default=20.0, help="minutes lost per restart")
    parser.add_argument("--headroom-gib", type=float, default=None,
                        help="per GPU, outside the allocator: CUDA context, NCCL and cuBLAS workspaces (default "
                             "2.5; with --measure, added to the rank's peak in the check against the device)")
    parser.add_argument("--fragmentation", type=float, default=None,
                        help="allocator fragmentation, share of peak (default 0.05; with --measure, as above)")
    parser.add_argument("--max-gpus", type=int, default=_MAX_GPUS, help="largest GPU count the fit search tries")
    parser.add_argument("--no-data", action="store_true", help="do not read and pack the recipe's data")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_measure_options(parser.add_argument_group("one rank of the job, measured on this machine's GPU (--measure)"))


def _add_measure_options(measure: argparse._ArgumentGroup) -> None:
    measure.add_argument("--measure", action="store_true",
                         help="run rank --rank of the recipe's layout here (other ranks stood in for, random weights, "
                              "synthetic rows) and print its memory and time beside the plan")
    measure.add_argument("--rank", type=int, default=None, help="the global rank to run (default: the plan's busiest)")
    measure.add_argument("--steps", type=int, default=None, help="timed steps (default 2)")
    measure.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default 1)")
    measure.add_argument("--nvlink-gbps", type=float, default=None,
                         help="GB/s of a collective within a node, for the transfer estimate (default 360)")
    measure.add_argument("--fabric-gbps", type=float, default=None,
                         help="GB/s per GPU between nodes, for the transfer estimate (default 40)")
    measure.add_argument("--link-latency-us", type=float, default=None,
                         help="microseconds per message of a collective (ring step), either link (default 5)")
    measure.add_argument("--emulate-links", action="store_const", const=True, default=None,
                         help="then time --steps more steps in which each collective holds its group's communication "
                              "stream for the links' time, so the step feels what its schedule does not hide")
    measure.add_argument("--profile", default=None, metavar="DIR",
                         help="run the timed steps under torch.profiler and write its kernel table, a summary by "
                              "stream and kind of work, the time by glmtune source line and the Chrome trace into "
                              "DIR (a new directory)")
    measure.add_argument("--profile-phase", choices=("timed", "emulated"), default=None,
                         help="which steps --profile records: the timed steps (default; the links free) or, with "
                              "--emulate-links, the emulated ones, whose timeline (rank{R}_timeline.txt, on a GPU) "
                              "shows what the schedule hid of each transfer")


_OPTIONS = RecipeOptions("glmtune plan", _add_options)

# Every numeric option: (lowest, highest, whether the lowest itself is excluded). A NaN compares
# false with everything, so each bound is written as what must hold, and floats must be finite.
_RANGES = {
    "gpus": (1, math.inf, False),
    "max_gpus": (1, math.inf, False),
    "restarts": (0, math.inf, False),
    "price_per_gpu_hour": (0, math.inf, True),
    "tflops_per_gpu": (0, math.inf, True),
    "epochs": (0, math.inf, True),
    "write_gbps": (0, math.inf, True),
    "restart_minutes": (0, math.inf, False),
    "headroom_gib": (0, math.inf, False),
    "fragmentation": (0, 1, False),  # a share of the peak: negative would let a plan fit what cannot
    "rank": (0, math.inf, False),
    "steps": (1, math.inf, False),
    "warmup_steps": (0, math.inf, False),
    "nvlink_gbps": (0, math.inf, True),
    "fabric_gbps": (0, math.inf, True),
    "link_latency_us": (0, math.inf, False),
}
_MEASURE_ONLY = ("rank", "steps", "warmup_steps", "nvlink_gbps", "fabric_gbps", "link_latency_us", "emulate_links",
                 "profile", "profile_phase")
# What --measure does not use (a plan's time, cost and fit come from the plan without it).
_NOT_WITH_MEASURE = {"gpu": None, "price_per_gpu_hour": None, "throughput": None, "tflops_per_gpu": None,
                     "measured_gpu": None, "epochs": None, "restarts": None, "max_gpus": _MAX_GPUS, "no_data": False}


def check_measure_options(args: argparse.Namespace) -> None:
    """--measure's options only with it, and the plan-only options not with it: one line each."""
    if not args.measure:
        for name in _MEASURE_ONLY:
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is an option of --measure; add --measure")
        return
    if args.profile_phase is not None and args.profile is None:
        raise ValueError("--profile-phase chooses the steps --profile records; add --profile DIR")
    if args.profile_phase == "emulated" and not args.emulate_links:
        raise ValueError("--profile-phase emulated records the steps run with emulated links; add --emulate-links")
    for name, default in _NOT_WITH_MEASURE.items():
        if getattr(args, name) != default:
            raise ValueError(f"--{name.replace('_', '-')} is not used by --measure (it measures one rank's memory "
                             "and time); run `glmtune plan` without --measure for it")


def check_numbers(args: argparse.Namespace) -> None:
    """Each numeric option given is finite and in its range (`_RANGES`); else one line naming it."""
    for name, (low, high, low_excluded) in _RANGES.items():
        value = getattr(args, name)
        if value is None:
            continue
        above = value > low if low_excluded else value >= low
        if math.isfinite(value) and above and value <= high:
            continue
        bound = f"in [{low}, {high}]" if high != math.inf else f"{'>' if low_excluded else '>='} {low}"
        kind = "" if isinstance(value, int) else "a finite number "
        raise ValueError(f"--{name.replace('_', '-')} must be {kind}{bound}, got {value}")


def check_headroom(headroom_gib: float, gpus: list) -> None:
    """A headroom a targeted GPU cannot hold is refused: every layout would show a negative free memory."""
    for gpu in gpus:
        if headroom_gib >= gpu.memory_gib:
            raise ValueError(f"--headroom-gib {headroom_gib:g} is not below the {gpu.key}'s {gpu.memory_gib:g} GiB of "
                             "memory: no layout could fit beside it; give the GiB each GPU keeps outside the "
                             "allocator (default 2.5)")


def register(subparsers: argparse._SubParsersAction) -> None:
    _OPTIONS.register(
        subparsers, "plan", help="memory, GPUs, time and cost of a recipe before running it",
        description="Plan RECIPE: model-state floor, per-GPU memory of its layout, fit per GPU kind, the "
                    "smallest GPU count that fits, tokens per epoch of its data, time and cost from a measurement.",
        overrides_help="dotted overrides, as for glmtune train (the options above may come among them)", func=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.config import load_config
    from glmtune.plan.assemble import PlanOptions, build_plan
    from glmtune.plan.cost import FailureBudget
    from glmtune.plan.hardware import gpu_spec
    from glmtune.plan.plan_report import print_report
    from glmtune.plan.throughput_source import Measurement, read_measurement

    args.overrides = _OPTIONS.parse(args)
    check_numbers(args)
    check_measure_options(args)
    if args.throughput and args.tflops_per_gpu:
        raise ValueError("give --throughput or --tflops-per-gpu, not both")
    if args.measured_gpu and not args.tflops_per_gpu:
        raise ValueError("--measured-gpu describes --tflops-per-gpu; a --throughput source names its GPU itself")
    cfg = load_config(args.recipe, args.overrides)
    if args.measure:
        return _measure(args, cfg)
    gpus = args.gpu or ["h100-80g", "h200-141g"]
    headroom = PlanOptions.context_gib if args.headroom_gib is None else args.headroom_gib
    check_headroom(headroom, [gpu_spec(key) for key in gpus])
    measurement = read_measurement(args.throughput) if args.throughput else None
    if args.tflops_per_gpu:
        measured = args.measured_gpu or gpus[0]
        peak = gpu_spec(measured).bf16_tflops
        if args.tflops_per_gpu > peak:  # a typo or another unit: a plan from it would be off by that much
            raise ValueError(f"--tflops-per-gpu {args.tflops_per_gpu:g} is above the dense bf16 peak of {measured} "
                             f"({peak:g} TFLOP/s), which no run reaches; give the model TFLOP/s per GPU measured")
        measurement = Measurement("--tflops-per-gpu", args.tflops_per_gpu, peak, 1)
    options = PlanOptions(gpus=gpus, world_size=args.gpus, price_per_gpu_hour=args.price_per_gpu_hour,
                          measurement=measurement, context_gib=headroom,
                          fragmentation=PlanOptions.fragmentation if args.fragmentation is None else args.fragmentation,
                          budget=FailureBudget(write_gbps=args.write_gbps, restart_minutes=args.restart_minutes,
                                               restarts=args.restarts),
                          epochs=args.epochs, read_data=not args.no_data, max_gpus=args.max_gpus)
    report = build_plan(cfg, args.recipe, options)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, Console())
    return 0


def _measure(args: argparse.Namespace, cfg) -> int:
    from rich.console import Console

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.io.outputs import check_output, output_dir
    from glmtune.plan.assemble import with_world
    from glmtune.plan.comm import Links
    from glmtune.plan.measure import check_device_holds, measure_rank, planned_for
    from glmtune.plan.measure_report import measure_report, print_measure
    from glmtune.plan.planner import degrees_for

    if args.gpus is not None:
        cfg = with_world(cfg, args.gpus)
    degrees = degrees_for(cfg)
    if args.rank is not None and args.rank >= degrees.world_size:
        raise ValueError(f"--rank {args.rank}: the recipe's world has ranks 0..{degrees.world_size - 1} "
                         f"({degrees.describe()})")
    plan = planned_for(cfg, degrees, args.rank)
    rank = plan.rank
    defaults = Links()
    links = Links(args.nvlink_gbps or defaults.nvlink_gbps, args.fabric_gbps or defaults.fabric_gbps,
                  cfg.parallel.gpus_per_node or defaults.gpus_per_node,
                  defaults.latency_us if args.link_latency_us is None else args.link_latency_us)
    check_device_holds(plan, *_device_memory(cfg), context_gib=args.headroom_gib, fragmentation=args.fragmentation)
    if args.profile is not None:
        check_output(args.profile, what="--profile")
    console = Console(stderr=True)
    console.print(f"measuring rank {rank} of {degrees.describe()}")
    with output_dir(args.profile, what="--profile") if args.profile is not None else nullcontext() as profile_dir:
        measured = measure_rank(cfg, degrees, rank, steps=args.steps or 2,
                                warmup=1 if args.warmup_steps is None else args.warmup_steps, say=console.print,
                                links=links if args.emulate_links else None, profile_dir=profile_dir,
                                profile_phase=args.profile_phase or "timed")
    if args.profile is not None and "error" not in (measured.profile or {}):
        timeline = f", rank{rank}_timeline.txt" if {"timeline", "timeline_error"} & set(measured.profile) else ""
        console.print(f"wrote the {args.profile_phase or 'timed'} steps' profile: {args.profile} "
                      f"(rank{rank}_kernels.txt, rank{rank}_summary.json, rank{rank}_sources.txt, "
                      f"rank{rank}_trace.json{timeline})")
    report = measure_report(cfg, args.recipe, measured, plan, links)
    if args.json:  # one line: a --throughput source as it is
        print(json.dumps(report))
    else:
        print_measure(report, Console())
    return 0


def _device_memory(cfg) -> tuple[int | None, str]:
    """(bytes, name) of the memory the rank would run in: the GPU's total, or on a CPU the host's
    available memory (None where the system does not say)."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    import torch
    from glmtune.plan.measure import host_available_bytes
    from glmtune.train.process import resolve_device

    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1], torch.cuda.get_device_name(device)
    return host_available_bytes(), "CPU (available memory)"
