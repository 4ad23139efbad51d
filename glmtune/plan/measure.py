"""`glmtune plan RECIPE --measure`: one rank of the recipe's job, run on this machine's device.

Rank R of the recipe's world is built exactly as a real run builds it: the model on the meta
device (FP8 base and LoRA as the recipe sets them), the family's parallelization plan over the
recipe's mesh (EP, AC, compile, FSDP2 with the recipe's precision), the run's optimizer,
schedule and trainer. Only two things stand in for what one device cannot have:

  * the other ranks: the process group is `glmtune.distributed.loopback` (rank R of N, every
    collective allocating and moving its real bytes locally, other ranks copies of this one;
    an expert-parallel rank's experts receive T*K rows, split over them by the real router);
  * the checkpoint and the data: random weights in the checkpoint's dtypes
    (`random_weights.py`) and rows of one full-length document (the costliest attention a
    packed row can have), every token supervised.

It then trains `warmup + steps` steps and reports, beside the plan for the same rank: the
peak of `torch.cuda.max_memory_allocated` (what the plan's peak stands for), the model state
after the first step, and the time of a step split into the micro-batches' forward, their
backward and the optimizer (CUDA events; wall clock on CPU). Transfers are not timed (they
are local copies here): `comm.py` estimates them from the bytes each group moved.
"""

from __future__ import annotations

import copy
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from glmtune.config import JobConfig, grad_accum_steps
from glmtune.config.degrees import MeshDegrees, raise_config_errors
from glmtune.config.validate import device_errors
from glmtune.distributed.link_emulator import LinkEmulator, emulated_links
from glmtune.distributed.link_model import Links
from glmtune.distributed.loopback import join_loopback_world, moved_bytes_by_group
from glmtune.distributed.mesh import ParallelMesh
from glmtune.models.registry import model_spec
from glmtune.plan.memory import MemoryPlan, plan_rank_memory
from glmtune.plan.model_state import build_meta_model, rank_state
from glmtune.plan.planner import plan_memory
from glmtune.plan.random_weights import fill_random_weights
from glmtune.plan.step_profile import profiled, write_profile
from glmtune.train.data_loader import PackedRowLoader
from glmtune.train.lr_schedule import build_scheduler
from glmtune.train.optim import build_optimizer
from glmtune.train.precision import resolve_precision
from glmtune.train.process import DistributedInfo, resolve_device
from glmtune.train.run import (
    Launch,
    RunHooks,
    objective,
    pipeline_options,
    trainer_settings,
)
from glmtune.train.trainer import Trainer

GIB = 2**30
# The timed steps' links: collectives cost nothing, but their stand-in copies run on the lanes
# (CUDA: side streams), so the timed compute is the rank's own work.
FREE_LINKS = Links(float("inf"), float("inf"), latency_us=0.0)
MEMINFO = Path("/proc/meminfo")


@dataclass
class StepTimes:
    """Seconds of one step on this rank: its micro-batches' forward and backward (under a
    pipeline both run inside the schedule: `forward` None, `backward` both), the optimizer."""

    forward: float | None
    backward: float
    optimizer: float
    total: float


@dataclass
class RankMeasurement:
    rank: int
    device: str
    degrees: MeshDegrees
    micro_batches: int  # per step on this rank (gradient accumulation)
    tokens_per_micro_batch: int
    flops_per_token: float  # the family's formula at this sequence length, one document
    state_bytes: int | None  # CUDA memory allocated after the first step (None on CPU)
    peak_bytes: int | None  # torch.cuda.max_memory_allocated over every step (None on CPU)
    steps: list[StepTimes] = field(default_factory=list)  # the timed ones (after the warm-up)
    comm_bytes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per mesh axis, one step (comm.py)
    losses: list[float] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)  # after the first step: local params, grads, AdamW moments
    first_micro_losses: list[float] = field(default_factory=list)  # the first step's, each micro-batch's loss sum
    # CUDA only: the plan's phase names -> memory allocated when the phase began, the largest over the
    # timed steps' micro-batches ("forward end": after a step's last forward; "layer i backward":
    # when layer i's backward starts, before its recomputation and scratch)
    phase_starts: dict[str, int] = field(default_factory=dict)
    # the auxiliary losses' means of each timed step, as the trainer logs them (proof they ran)
    auxiliary_losses: list[dict[str, float]] = field(default_factory=list)
    # with emulated links (`link_emulator.py`): the steps timed after the compute steps, each group's
    # lane's modeled seconds per step by collective (keyed as comm_bytes), and the links
    emulated_steps: list[StepTimes] = field(default_factory=list)
    lane_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    links: Links | None = None
    profile: dict[str, Any] | None = None  # --profile: the timed steps' summary (step_profile.py)

    @property
    def step(self) -> StepTimes:
        """The timed steps' mean."""
        return mean_step(self.steps)

    @property
    def emulated_step(self) -> StepTimes | None:
        """The emulated steps' mean (None without emulation)."""
        return mean_step(self.emulated_steps) if self.emulated_steps else None


def mean_step(steps: list[StepTimes]) -> StepTimes:
    n = len(steps)
    forward = None if steps[0].forward is None else sum(s.forward for s in steps) / n
    return StepTimes(forward, *(sum(getattr(s, k) for s in steps) / n for k in ("backward", "optimizer", "total")))


def synthetic_rows(count: int, seq_len: int, vocab_size: int, seed: int, documents: int = 1
                   ) -> list[dict[str, list[int]]]:
    """`count` copies of one packed row: `documents` documents of equal length (one: the costliest
    attention a row can have; two: a preference pair, chosen and rejected) of random tokens, every
    token supervised but each document's first. Every rank reads the same tokens (their values
    change neither time nor memory), so a data-parallel rank under the loopback group computes
    what the real one does."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (seq_len,), generator=generator).tolist()
    length = seq_len // documents
    document_ids = [min(i // length, documents - 1) for i in range(seq_len)]
    starts = {i * length for i in range(documents)}
    positions = [i - document_ids[i] * length for i in range(seq_len)]
    labels = [-100 if i in starts else token for i, token in enumerate(ids)]
    row = {"input_ids": ids, "labels": labels, "position_ids": positions, "document_ids": document_ids}
    return [row] * count


def host_available_bytes(meminfo: Path | None = None) -> int | None:
    """The host memory a new process can have without swapping: /proc/meminfo's MemAvailable (free
    memory plus the page cache and reclaimable slabs the kernel would drop). MemFree alone leaves
    the cache out, and a busy host fills its memory with cache: 0.1 GiB free can be 13 GiB
    available. None where the system does not say (no /proc/meminfo)."""
    try:
        text = (meminfo or MEMINFO).read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB\s*$", text, re.MULTILINE)
    return int(found[1]) * 1024 if found else None


def check_device_holds(plan: MemoryPlan, device_bytes: int | None, device_name: str,
                       context_gib: float | None = None, fragmentation: float | None = None) -> None:
    """Refuse, before anything is allocated, a rank whose planned peak exceeds the whole device
    (`device_bytes`: a GPU's total, a host's available memory; None: unknown, not checked): it
    could only fail part-way (on a host, by swapping or being killed). The plan is within 7% of
    the measured ranks (docs/plan.md), so a rank planned just under the device's size is tried.
    `context_gib` and `fragmentation` (`--headroom-gib`, `--fragmentation`, when given) come on top
    of the peak; a headroom the device cannot hold at all is refused on its own."""
    if device_bytes is None:
        return
    have = f"this {device_name} has {device_bytes / GIB:.1f} GiB"
    if context_gib is not None and context_gib * GIB >= device_bytes:
        raise ValueError(f"--headroom-gib {context_gib:g} is not below what {have}: no rank could fit beside it; "
                         "give the GiB the run keeps outside the allocator (default 2.5)")
    need = plan.peak.total * (1 + (fragmentation or 0.0)) + (context_gib or 0.0) * GIB
    if need > device_bytes:
        asked = "" if context_gib is None and fragmentation is None else (
            f" + the headroom given (--headroom-gib {context_gib or 0:g}, --fragmentation {fragmentation or 0:g}) "
            f"= {need / GIB:.1f} GiB")
        raise ValueError(f"rank {plan.rank} plans {plan.peak.total / GIB:.1f} GiB at its peak ({plan.peak.name})"
                         f"{asked}; {have}: measure it on a larger GPU, or a rank of a layout with more ranks (--gpus)")


def planned_for(cfg: JobConfig, degrees: MeshDegrees, rank: int | None) -> MemoryPlan:
    """The plan of rank `rank`; None: of the busiest rank the plan names (the first rank of the
    busiest pipeline stage)."""
    if rank is None:
        return plan_memory(cfg, degrees=degrees)
    model = build_meta_model(cfg)
    return plan_rank_memory(model, cfg, degrees, rank, rank_state(model, cfg, degrees, rank), True)


class _Clock:
    """Marks in a step, as CUDA events (or wall-clock times on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, time.perf_counter()))

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def step_times(self) -> StepTimes:
        """Forward: each forward's start to its end; backward: each forward's end to the next
        forward's start or to the gradients; optimizer: gradients to the step's end."""
        if self.cuda:
            torch.cuda.synchronize()
        marks = self.marks
        forwards = [self.seconds(a, b) for (name, a), (_, b) in zip(marks, marks[1:]) if name == "forward"]
        forward = sum(forwards) if forwards else None
        at = dict((name, value) for name, value in marks)
        total = self.seconds(marks[0][1], at["end"])
        to_grads = self.seconds(marks[0][1], at["gradients"])
        optimizer = self.seconds(at["gradients"], at["end"])
        self.marks = []
        return StepTimes(forward, to_grads - (forward or 0.0), optimizer, total)


AUXILIARY_LOSSES = ("mtp_loss", "indexer_kl")  # trainer metrics of `train.mtp_loss_weight`, `indexer_loss_weight`


def _launch(cfg: JobConfig, degrees: MeshDegrees, rank: int, device: torch.device) -> Launch:
    return Launch(model_spec(cfg.model), device, DistributedInfo(rank, degrees.world_size, 0, False), degrees,
                  resolve_precision(cfg), grad_accum_steps(cfg, degrees), Path(cfg.logging.run_dir))


def _build(cfg: JobConfig, launch: Launch, mesh: ParallelMesh) -> nn.Module:
    """The rank's share of the model on its device: meta, parallelized, random weights."""
    spec = launch.spec
    model = build_meta_model(cfg)
    spec.compute.parallelize(model, mesh, cfg.parallel, pipeline=pipeline_options(cfg, launch))
    std = spec.memory.weight_std(spec.architecture.args_of(model))
    fill_random_weights(model, launch.device, std, cfg.train.seed, spec.weights.reset_buffers)
    return model


def _written_profile(prof, profile_dir: Path, rank: int, on_device: bool, steps: int, say) -> dict[str, Any]:
    """`write_profile`'s summary, or {"error": ...} when the profile cannot be read or written: a
    diagnostic that fails must not cost the measurement it rode on (the report still comes)."""
    try:
        return write_profile(prof, profile_dir, rank, on_device, steps)
    except Exception as exc:  # noqa: BLE001 - torch's profiler parse, the disk: reported, the measurement kept
        say(f"the timed steps' profile could not be written: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}


def measure_rank(cfg: JobConfig, degrees: MeshDegrees, rank: int, steps: int = 2, warmup: int = 1,
                 say=lambda message: None, links: Links | None = None,
                 profile_dir: Path | None = None, profile_phase: str = "timed") -> RankMeasurement:
    """Run rank `rank` of `cfg`'s job (`degrees`) for `warmup + steps` steps (module docstring),
    and `steps` more with `links` emulated when given; `say` hears what it is doing (a line per
    stage and step). With `profile_dir` (an existing directory), the steps of `profile_phase`
    ("timed", or "emulated" with `links`) run under torch.profiler and its tables are written there
    (`step_profile.py`)."""
    with join_loopback_world(rank, degrees.world_size):
        return measure_in_world(cfg, degrees, steps, warmup, say, links, profile_dir, profile_phase)


def measure_in_world(cfg: JobConfig, degrees: MeshDegrees, steps: int = 2, warmup: int = 1,
                     say=lambda message: None, links: Links | None = None,
                     profile_dir: Path | None = None, profile_phase: str = "timed") -> RankMeasurement:
    """`measure_rank` in the process group that exists: the loopback world, or a real one (the
    tests run the same on gloo ranks and compare; emulated links act on loopback groups only)."""
    assert profile_phase == "timed" or (profile_phase == "emulated" and links), profile_phase
    cfg = copy.deepcopy(cfg)
    cfg.logging.progress = False
    device = resolve_device(cfg.train.device)
    raise_config_errors(device_errors(cfg, device.type))
    rank = dist.get_rank()
    torch.manual_seed(cfg.train.seed)
    launch = _launch(cfg, degrees, rank, device)
    mesh = ParallelMesh(degrees, device_type=device.type)
    started = time.perf_counter()
    model = _build(cfg, launch, mesh)
    say(f"rank {rank}'s share built on {device} in {time.perf_counter() - started:.0f} s"
        + (f", {torch.cuda.memory_allocated(device) / GIB:.1f} GiB" if device.type == "cuda" else ""))
    clock = _Clock(device)
    hooks = RunHooks(on_gradients=lambda step, m: clock.mark("gradients"),
                     on_optimizer_step=lambda step, m, opt: step == 1 and result.held.update(held_bytes(m, opt)))
    micro_losses: list[torch.Tensor] = []
    if degrees.pp == 1:  # a pipeline's stages run inside its schedule: no per-micro-batch forward marks
        _mark_micro_batches(model, clock, micro_losses)
    seq = cfg.data.packed_sequence_size
    result = RankMeasurement(rank, str(device), degrees, launch.grad_accum, cfg.train.micro_batch_size * seq,
                             launch.spec.architecture.flops_per_token(launch.spec.architecture.args_of(model), [seq]), None, None)
    total = warmup + steps * (2 if links else 1)
    trainer = _trainer(cfg, launch, model, mesh, hooks, total)
    probe = _PhaseProbe(model, device, trainer.runner)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    axes = _group_axes(mesh)

    def lanes(name: str, ranks: list[int]) -> str:  # a lane named as the report names its group
        return _group_key(name, ranks, axes)

    phases = [("warm-up", warmup, None), ("timed", steps, FREE_LINKS)] + ([("emulated", steps, links)] if links else [])
    done = 0
    for phase, count, phase_links in phases:
        profiling = profile_dir is not None and phase == profile_phase
        with (emulated_links(phase_links, device, lanes) if phase_links else nullcontext()) as emulator, \
                (profiled(device, with_stack=phase == "timed") if profiling else nullcontext()) as prof:
            for _ in range(count):
                done += 1
                _one_step(trainer, clock, probe, result, micro_losses, phase, (done, total), axes, say)
        if profiling:
            result.profile = _written_profile(prof, profile_dir, rank, device.type == "cuda", count, say)
        if phase == "emulated":
            result.links = links
            result.lane_seconds = _lane_seconds(emulator, axes, count)
    if device.type == "cuda":
        result.peak_bytes = torch.cuda.max_memory_allocated(device)
    result.phase_starts = probe.seen
    return result


def _mark_micro_batches(model: nn.Module, clock: _Clock, micro_losses: list[torch.Tensor]) -> None:
    """Each forward's start and end marked on `clock` (the end starts the backward), and each
    micro-batch's loss sum kept in `micro_losses`."""
    model.register_forward_pre_hook(lambda m, a: clock.mark("forward"))

    def forward_done(module, args, out) -> None:
        clock.mark("backward")
        if out.loss_sum is not None:  # a preference objective's forwards return log-probabilities
            micro_losses.append(out.loss_sum.detach())

    model.register_forward_hook(forward_done)


def _one_step(trainer: Trainer, clock: _Clock, probe: _PhaseProbe, result: RankMeasurement,
              micro_losses: list[torch.Tensor], phase: str, counter: tuple[int, int], axes: dict[str, str],
              say) -> None:
    """Step `counter[0]` of `counter[1]`, of the phase "warm-up", "timed" or "emulated": its times
    and figures kept."""
    before = moved_bytes_by_group()
    probe.recording = phase != "warm-up"
    clock.mark("start")
    record = trainer.train_step()
    clock.mark("end")
    times = clock.step_times()
    say(f"step {counter[0]}/{counter[1]}{'' if phase == 'timed' else f' ({phase})'}: {times.total:.2f} s, "
        f"loss {record['loss']:.4f}")
    if counter[0] == 1:
        result.state_bytes = torch.cuda.memory_allocated() if clock.cuda else None
        result.first_micro_losses = [float(loss) for loss in micro_losses]
    micro_losses.clear()
    if phase == "timed":
        result.steps.append(times)
        result.losses.append(record["loss"])
        result.auxiliary_losses.append({k: record[k] for k in AUXILIARY_LOSSES if k in record})
        result.comm_bytes = _difference(moved_bytes_by_group(), before, axes)
    elif phase == "emulated":
        result.emulated_steps.append(times)


def _lane_seconds(emulator: LinkEmulator, axes: dict[str, str], steps: int) -> dict[str, dict[str, float]]:
    """Each group's lane's modeled seconds per emulated step, by collective, keyed by its axes."""
    out: dict[str, dict[str, float]] = {}
    for name, (ranks, seconds) in emulator.seconds_by_group().items():
        entry = out.setdefault(_group_key(name, ranks, axes), {})
        for op, value in seconds.items():
            entry[op] = entry.get(op, 0.0) + value / steps
    return out


class _PhaseProbe:
    """Memory allocated at the start of each of the plan's phases (see `RankMeasurement`)."""

    def __init__(self, model: nn.Module, device: torch.device, runner) -> None:
        self.on = device.type == "cuda"
        self.seen: dict[str, int] = {}
        self.recording = False
        layers = {}
        for root in runner.roots:  # the model, and a pipeline's stages
            for name, module in root.named_modules():
                found = re.search(r"(?:^|\.)layers\.(\d+)$", name)
                if found:
                    layers[int(found.group(1))] = module
        for index, module in layers.items():
            module.register_full_backward_pre_hook(lambda m, grad, i=index: self.note(f"layer {i} backward"))
        # the whole model's forward (a pipeline's stages run their layers without it: never noted)
        model.register_forward_hook(lambda m, a, out: self.note("forward end"))

    def note(self, phase: str) -> None:
        if self.on and self.recording:
            self.seen[phase] = max(self.seen.get(phase, 0), torch.cuda.memory_allocated())


def _trainer(cfg: JobConfig, launch: Launch, model: nn.Module, mesh: ParallelMesh, hooks: RunHooks,
             steps: int) -> Trainer:
    """The run's optimizer, schedule and trainer, reading `synthetic_rows` (no checkpoints, no metrics)."""
    o, degrees = cfg.optim, launch.degrees
    optimizer = build_optimizer(model, o.lr, o.weight_decay, o.betas, o.eps, o.fused,
                                masters=launch.precision.masters)
    scheduler = build_scheduler(optimizer, o.warmup_steps_for(cfg.train.max_steps), max(cfg.train.max_steps, steps),
                                o.scheduler, o.min_lr_ratio)
    vocab = launch.spec.architecture.vocab_size(launch.spec.architecture.args_of(model))
    rows = synthetic_rows(cfg.train.micro_batch_size * degrees.dp, cfg.data.packed_sequence_size, vocab,
                          cfg.train.seed, documents=2 if cfg.train.objective == "dpo" else 1)
    loader = PackedRowLoader(rows, cfg.train.micro_batch_size, cfg.train.seed, mesh.dp_rank, degrees.dp)
    settings = objective(cfg, trainer_settings(cfg, launch, model, mesh, hooks))
    return Trainer(model, optimizer, scheduler, launch.spec.compute.step_runner(model), loader, None, None, None, settings)


def held_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    """The local bytes of the parameters, gradients and AdamW state: moments, and the fp32 masters an
    optimizer holding them keeps (`MasterAdamW.masters`; DTensors: their shards)."""
    def size(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    moments = sum(size(state[k]) for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in state)
    masters = sum(size(master) for master in getattr(optimizer, "masters", {}).values())
    return {"params": params, "grads": grads, "optimizer": moments + masters}


# Mesh axes a process group may serve (one group can serve several: ep and dp_shard over the
# same eight ranks are one group).
_AXES = ("ep", "efsdp", "cp", "pp", "dp_replicate", "dp_shard", "dp_shard_cp", "dp", "loss")


def _group_axes(mesh: ParallelMesh) -> dict[str, str]:
    """Process-group name -> the mesh axes it serves, joined by "+" (axes of size > 1)."""
    names: dict[str, list[str]] = {}
    for axis in _AXES:
        if mesh.size(axis) <= 1:
            continue
        try:
            names.setdefault(mesh.group(axis).group_name, []).append(axis)
        except ValueError:  # an axis this layout builds no mesh for
            continue
    return {name: "+".join(axes) for name, axes in names.items()}


def _group_key(name: str, ranks: list[int], axes: dict[str, str]) -> str:
    """A group's key in the report: its mesh axes, else "world" or its size."""
    return axes.get(name, "world" if len(ranks) == dist.get_world_size() else f"{len(ranks)} ranks")


def _difference(after: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]],
                axes: dict[str, str]) -> dict[str, dict[str, Any]]:
    """What each group moved between two snapshots (bytes and collectives issued, by kind), keyed
    by its axis (or its ranks)."""
    out: dict[str, dict[str, Any]] = {}
    for name, group in after.items():
        entry = None
        for what in ("bytes", "calls"):
            earlier = before.get(name, {}).get(what, {})
            moved = {op: count - earlier.get(op, 0) for op, count in group[what].items()}
            moved = {op: n for op, n in moved.items() if n}
            if moved:
                entry = entry or out.setdefault(_group_key(name, group["ranks"], axes),
                                                {"ranks": group["ranks"], "bytes": {}, "calls": {}})
                for op, n in moved.items():
                    entry[what][op] = entry[what].get(op, 0) + n
    return out
