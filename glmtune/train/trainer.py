"""The training loop. Model-agnostic: it sees a module, batches and the step runner that runs them.

One optimizer step = `grad_accum` micro-batches. The loss is the mean over every
supervised token of the step (all micro-batches and ranks together), so changing
the micro-batch split does not change the update. Each step:
  forward/backward per micro-batch -> all-reduce token counts -> clip -> AdamW ->
  LR schedule -> optional router-bias update -> metrics -> maybe validate/save.

Each micro-batch of the data loader becomes one typed `MicroBatch` (models/common/microbatch.py),
built here once: this rank's supervised targets, the step's totals and loss factor, the auxiliary
losses sized for the step. The model family's step runner (models/common/step_runner.py: the
whole model, or a pipeline's stages) runs it: the family's next-token loss, or another objective's
loss of the rows (`TrainerSettings.rows_loss`, a preference objective's).

Safety: a non-finite loss stops the run before the optimizer step, keeping the
last good checkpoint untouched; SIGTERM/SIGINT/SIGUSR1 (Slurm's warning before the time
limit) or the stop file (`settings.stop_file`, created by the Slurm batch script) finish
the current step, save one checkpoint on every rank and exit, so a preempted job resumes
where it stopped.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from glmtune.checkpoint.manager import STATE_NAME, CheckpointManager
from glmtune.distributed.agreement import decide_on_rank0
from glmtune.distributed.fsdp_state import release_gathered
from glmtune.models.common.aux_loss import AuxiliaryLosses
from glmtune.models.common.microbatch import MicroBatch
from glmtune.models.common.step_runner import RowsLoss, StepRunner
from glmtune.train.data_loader import PackedRowLoader
from glmtune.train.metrics import MetricsWriter, routing_stats
from glmtune.train.progress import StepProgress
from glmtune.train.resume_state import Configured, apply_configured, check_position
from glmtune.train.router_balance import update_router_biases

# (step runner, micro-batch) -> the micro-batch to run: what an objective adds to it before it runs
# (a preference objective's reference log-probabilities, from the LoRA model with its adapters off).
Prepare = Callable[[StepRunner, MicroBatch], MicroBatch]


def non_padding_queries(batch: dict[str, Any]) -> int:
    """The batch's queries that are not padding (the indexer KL's unit), counted on the host."""
    return int((batch["document_ids"] >= 0).sum())


@dataclass(frozen=True)
class NextTokenUnits:
    """The next-token loss's units, counted on the host by the loader: the batch's supervised
    tokens; with `mtp` the MTP layer's own (its loss is averaged over them), with `queries` the
    non-padding queries (the indexer KL is averaged over them): the step's totals size the
    auxiliary losses (`MicroBatch.aux`)."""

    mtp: bool = False
    queries: bool = False

    def __call__(self, batch: dict[str, Any]) -> dict[str, int]:
        units = {"tokens": batch["num_supervised"]}
        if self.mtp:
            units["mtp_tokens"] = batch["num_mtp_supervised"]
        if self.queries:
            units["queries"] = non_padding_queries(batch)
        return units


supervised_tokens = NextTokenUnits()


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class TrainerSettings:
    max_steps: int
    grad_accum: int
    clip_grad_norm: float | None
    log_every: int
    val_every: int
    val_steps: int | None
    checkpoint_every: int
    save_at_end: bool = True  # false: the last step saves only when checkpoint_every (or a stop) asks
    router_bias_update: str = "none"
    router_bias_rate: float = 1e-3
    async_save: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: bool = True
    # Its appearance asks for a stop like a signal: a file on the shared run directory reaches
    # every rank, with no time limit (torchrun gives workers ~30 s after its SIGTERM). Nothing
    # removes it at start: a request made while a job starts up is honoured after the first step.
    stop_file: Path | None = None
    # Process groups beyond one process (None: all ranks): `row_group` joins the ranks that read
    # different rows (data parallel; context- and pipeline-parallel ranks share rows), whose
    # token counts add up; `stage_group` the ranks holding the same layers (pipeline stage),
    # whose expert loads add up; `pp_group` the ranks of one pipeline, each holding different
    # layers, whose gradient norms add up (None without pipeline parallelism).
    row_group: Any = None
    stage_group: Any = None
    pp_group: Any = None
    # Model FLOPs of a step's micro batches on this rank (glmtune/models/glm5/flops.py), and the
    # GPU's dense bf16 peak: the throughput record's TFLOP/s and MFU (None: not reported).
    step_flops: Callable[[list[dict[str, Any]]], float] | None = None
    peak_tflops: float | None = None
    # Called with (step, model) once a step's gradients are complete, before they are checked,
    # clipped and applied: `glmtune preflight` reads the gradient of every path there, even
    # when the trainer is about to refuse a non-finite one.
    on_gradients: Callable[[int, nn.Module], None] | None = None
    # Called with (step, model, optimizer) right after the update, before gradients are dropped.
    on_optimizer_step: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None
    # What the model family's spec says of the built model: its MoE layers (name, layer) the
    # forward routes through (router statistics, bias updates).
    moe_layers: list[tuple[str, nn.Module]] = field(default_factory=list)
    # Host counts of a micro-batch that the step totals (over its micro-batches and the data-parallel
    # ranks): the first is the loss's unit, each micro-loss sum is divided by its total; all of them
    # reach the loss as the micro-batch's `step_totals` (a preference objective's pairs and chosen tokens).
    unit_counts: Callable[[dict[str, Any]], dict[str, int]] = supervised_tokens
    # Another objective than the family's next-token loss: its loss of the rows (`RowsLoss`), and what
    # it adds to a micro-batch before it runs (`Prepare`); None: none.
    rows_loss: RowsLoss | None = None
    prepare: Prepare | None = None
    # The auxiliary losses' weights (train.mtp_loss_weight, train.indexer_loss_weight; None: none), and
    # the indexer warm-up's steps: the micro-batches of the first N optimizer steps (restored on resume)
    # run it (dense attention, only the indexers train), validation after step k as step k + 1 will.
    auxiliary: AuxiliaryLosses | None = None
    indexer_warmup_steps: int = 0
    # The router-bias update starts after this many steps (an indexer warm-up trains the indexers
    # alone: the main model, its routing included, stays as it is).
    router_bias_after: int = 0
    stats_prefix: str = ""  # the loss function's logged statistics are recorded as prefix + name
    # Metrics of a logging window kept outside the trainer, added to each logged record: the replay mix's
    # realized shares of the window's target tokens (MixedRowLoader.window_mix). None: none.
    window_metrics: Callable[[], dict[str, float]] | None = None
    # Validation rows of other sources (a replay mix's general data), each validated whenever the run's own
    # are, as val_loss/<name>; the run's own validation stays val_loss.
    source_val_loaders: dict[str, PackedRowLoader] = field(default_factory=dict)


@dataclass
class TrainResult:
    step: int
    interrupted: bool
    last_loss: float | None
    val_loss: float | None
    checkpoint: str | None
    losses: list[float] = field(default_factory=list)
    val_stats: dict[str, float] = field(default_factory=dict)  # the last validation's statistics, if any


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip the gradients of `params` to a global 2-norm of at most `max_norm`; that norm.

    Sharded gradients are DTensors, on as many meshes as the parameters were sharded over
    (routed experts under EP have their own): each mesh's norm is completed across its
    ranks (`full_tensor`), then the squares of all of them are summed in fp64. Every rank
    gets the same norm and the same clipping factor. Per-tensor norms are fp64 on the CPU,
    whose fp32 norm sums sequentially (2e-4 relative error on the tiny model's 524k-entry
    head gradient, which would make the norm depend on how the gradients are sharded), and
    fp32 on CUDA: its tree reductions are accurate in fp32, and the fused multi-tensor
    kernel has no fp64 output (an fp64 norm converted every bf16 gradient to fp64 first:
    ~40 ms a step on the GLM-5 proxy). Under pipeline parallelism each stage holds other
    parameters: the squared norms are summed over the pipeline (`pp_group`) too.

    Gradients are scaled only when the norm exceeds `max_norm` (the trainer reads the norm
    on the host anyway): torch's `clip_grads_with_norm_` multiplies every gradient by the
    clamped factor, 1.0 included, a full pass over the gradients on every step."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group]
        dtype = torch.float64 if grads[0].device.type == "cpu" else torch.float32
        per_tensor = torch.stack(torch._foreach_norm(grads, 2.0, dtype=dtype)).double()
        norm = torch.linalg.vector_norm(per_tensor)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros((), dtype=torch.float64)
    if pp_group is not None:
        squared = total.square()
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    value = float(total)
    factor = max_norm / (value + 1e-6)  # torch's clipping factor, clamped to 1 there
    if math.isfinite(value) and factor < 1.0:
        for group in by_mesh.values():  # one foreach per mesh: DTensors of different meshes do not mix
            torch._foreach_mul_([p.grad for p in group], factor)
    return total


def _all_reduce_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def _add_stats(sums: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    for name, value in stats.items():
        value = value.detach().to(torch.float64)
        sums[name] = sums[name] + value if name in sums else value


def _layer_order(key: str) -> tuple[int, str]:
    # "moe/model.layers.12.mlp/max_load" -> (12, key): layer 12 after layer 3, not between 1 and 2
    parts = key.split(".")
    return (int(parts[2]), key) if len(parts) > 2 and parts[2].isdigit() else (-1, key)


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, runner: StepRunner,
                 train_loader: PackedRowLoader, val_loader: PackedRowLoader | None,
                 checkpoints: CheckpointManager, metrics: MetricsWriter, settings: TrainerSettings,
                 console=None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.runner = runner
        self.train_loader = train_loader
        self.val_loader = val_loader
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.s = settings
        self.console = console
        self.step = 0
        self.tokens_seen = 0
        self._stop_reason: str | None = None  # what asked to stop: a signal's name or the stop file
        self._moe = settings.moe_layers
        self._window: dict[str, float] = {}  # throughput since the last logged step (`_throughput`)
        self.val_stats: dict[str, float] = {}  # the last validation's statistics (objectives that log some)

    # -- state ------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "loader": self.train_loader.state_dict(),
                "tokens_seen": self.tokens_seen}

    def resume(self, resume: str) -> int:
        """Load what `checkpoint.resume` names (see `CheckpointManager.restore`); the step reached."""
        configured = Configured.of(self.optimizer, self.scheduler)  # before the checkpoint's load over them
        checkpoint, state = self.checkpoints.restore(
            resume, self.model, self.optimizer, self._print, expected_state=self.trainer_state(),
            check_state=lambda read: check_position(read, STATE_NAME, self.train_loader))
        if checkpoint is None:
            return 0
        # The metrics file is read (rank 0's) before anything moves: a hostile line stops every rank alike.
        decide_on_rank0(lambda: len(self.metrics.kept_lines(checkpoint.step)))
        for moved in self.checkpoints.set_aside_after(checkpoint.step):
            self._print(f"set aside newer checkpoint {moved.name} (resuming from step {checkpoint.step})")
        self.scheduler.load_state_dict(state["scheduler"])
        apply_configured(self.optimizer, self.scheduler, configured, state["step"])
        self.train_loader.load_state_dict(state["loader"])
        self.tokens_seen = state["tokens_seen"]
        self.step = state["step"]
        self.metrics.truncate_after(self.step)
        self._print(f"resumed from {checkpoint.path} at step {self.step}")
        return self.step

    def save(self) -> str:
        path = self.checkpoints.save(self.step, self.model, self.optimizer, self.trainer_state(),
                                     async_save=self.s.async_save)
        return str(path)

    # -- one step ---------------------------------------------------------------------
    def _micro_batch(self, batch: dict[str, Any], step_totals: dict[str, int],
                     loss_scale: float | None = None) -> MicroBatch:
        """The runner's micro-batch of a host batch: this rank's supervised targets, the step's totals
        and loss factor, the auxiliary losses sized for the step, what the objective adds."""
        mb = MicroBatch.of_batch(batch, self.runner.local_tokens, loss_scale, step_totals, self.s.auxiliary,
                                 indexer_warmup=self.step < self.s.indexer_warmup_steps)
        return mb if self.s.prepare is None else self.s.prepare(self.runner, mb)

    def train_step(self) -> dict[str, Any]:
        self.model.train()
        data_start = time.perf_counter()
        batches = [self.train_loader.next_batch() for _ in range(self.s.grad_accum)]
        data_seconds = time.perf_counter() - data_start
        counts = [self.s.unit_counts(b) for b in batches]  # counted on the host
        keys = list(counts[0])
        local_counts = [sum(c[k] for c in counts) for k in keys]
        # int64: a float32 count is exact only up to 2**24 tokens per step.
        totals = _all_reduce_sum(torch.tensor(local_counts, dtype=torch.int64, device=self.s.device),
                                 self.s.row_group)
        total_targets = totals[0]
        denominator = total_targets.clamp_min(1).float()
        loss_sum = torch.zeros((), device=self.s.device)
        stat_sums: dict[str, torch.Tensor] = {}
        load = {name: torch.zeros_like(m.tokens_per_expert) for name, m in self._moe}
        # The factor each micro-loss is divided by, announced to the fused loss (its head
        # gradient comes out already scaled). Across processes the total is needed on the host:
        # one sync at the step's start, where the GPU is idle anyway after the last step's .item().
        totals_on_host = totals.tolist() if dist.is_initialized() else local_counts
        total_on_host = int(totals_on_host[0])
        step_totals = dict(zip(keys, (int(n) for n in totals_on_host)))
        for batch in batches:
            mb = self._micro_batch(batch, step_totals, 1.0 / max(total_on_host, 1))
            micro_loss, _, stats = self.runner.train(mb, denominator, self.s.rows_loss)
            loss_sum += micro_loss
            _add_stats(stat_sums, stats)
        for name, counts in self.runner.take_expert_load().items():
            load[name] += counts
        if self.s.on_gradients is not None:
            self.s.on_gradients(self.step + 1, self.model)
        loss = (_all_reduce_sum(loss_sum) / denominator).item()
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"loss is {loss} at step {self.step + 1}")
        params = [p for p in self.model.parameters() if p.grad is not None]
        # Clips when configured; with max_norm=inf it only measures. The norm is checked either way:
        # a finite loss can still come with inf/nan gradients (bf16 overflow in backward).
        grad_norm = float(clip_grad_norm_(params, self.s.clip_grad_norm or math.inf, self.s.pp_group))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"gradient norm is {grad_norm} at step {self.step + 1} (loss {loss:.4f})")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if self.s.on_optimizer_step is not None:
            self.s.on_optimizer_step(self.step + 1, self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        for name in load:
            _all_reduce_sum(load[name], self.s.stage_group)
        if self.s.router_bias_update == "sign" and self.step >= self.s.router_bias_after:
            update_router_biases(self._moe, load, self.s.router_bias_rate)
        self.step += 1
        self._count_tokens(batches, data_seconds)
        record: dict[str, Any] = {"step": self.step, "loss": loss, "lr": lr, "tokens": self.tokens_seen}
        record.update(self._units_record(keys, total_targets, step_totals))
        record.update(self._stat_means(stat_sums, denominator))  # its statistics' means per unit
        record["grad_norm"] = grad_norm
        record.update(self._routing_record(load))
        return record

    def _count_tokens(self, batches: list[dict[str, Any]], data_seconds: float) -> None:
        """The step's tokens over the data-parallel ranks (the others share rows): all tokens, non-padding
        ones and model FLOPs, into the run's count and the logging window."""
        local = [sum(int(b["input_ids"].numel()) for b in batches),
                 sum(int((b["document_ids"] >= 0).sum()) for b in batches),
                 self.s.step_flops(batches) if self.s.step_flops is not None else 0.0]
        tokens, real_tokens, flops = _all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=self.s.device),
                                                     self.s.row_group).tolist()
        self.tokens_seen += int(tokens)
        self._window_add(tokens=tokens, real_tokens=real_tokens, flops=flops, data_s=data_seconds)

    def _units_record(self, keys: list[str], total_targets: torch.Tensor, step_totals: dict[str, int]
                      ) -> dict[str, int]:
        """The step's loss units in the record: supervised tokens (and the step's other token totals), or
        another objective's units, named with its statistics' prefix."""
        if keys[0] == "tokens":
            return {"supervised_tokens": int(total_targets.item()),
                    **{k: n for k, n in step_totals.items() if k != "tokens"}}
        return {f"{self.s.stats_prefix}{k}": n for k, n in step_totals.items()}

    def _routing_record(self, load: dict[str, torch.Tensor]) -> dict[str, float]:
        """The step's routing statistics per MoE layer (`moe/<layer>/<stat>`): under a pipeline every
        stage's layers, gathered for rank 0, which writes the metrics, in layer order."""
        stats = {f"moe/{name}/{key}": value for name, counts in load.items()
                 for key, value in routing_stats(counts).items()}
        if self.s.pp_group is not None:
            gathered: list[dict] = [{} for _ in range(dist.get_world_size(self.s.pp_group))]
            dist.all_gather_object(gathered, stats, group=self.s.pp_group)
            stats = {k: v for part in gathered for k, v in part.items()}
            stats = dict(sorted(stats.items(), key=lambda item: _layer_order(item[0])))
        return stats

    def _stat_means(self, sums: dict[str, torch.Tensor], denominator: torch.Tensor, prefix: str = "") -> dict[str, float]:
        """The loss function's statistics summed over the step's (or validation's) micro-batches and
        the data-parallel ranks, per loss unit: one all-reduce of them all. A statistic given as a
        (sum, count) pair (an auxiliary loss and its own tokens) is reported as sum / count, its pairs
        summed over every rank in a second all-reduce: each rank's pair covers its own tokens (under
        context parallelism its queries; zeros off the last pipeline stage), and ranks that repeat a
        pair leave the ratio as it is."""
        values: dict[str, float] = {}
        means = sorted(n for n in sums if sums[n].numel() == 1)
        if means:
            total = _all_reduce_sum(torch.cat([sums[n].reshape(-1) for n in means]), self.s.row_group)
            if self.s.pp_group is not None:  # the last stage's statistics (zeros on the other stages)
                _all_reduce_sum(total, self.s.pp_group)
            units = float(denominator.to(torch.float64))
            values.update({name: value / units for name, value in zip(means, total.tolist())})
        pairs = sorted(n for n in sums if sums[n].numel() == 2)
        if pairs:
            total = _all_reduce_sum(torch.stack([sums[n].reshape(2) for n in pairs]))
            values.update({name: pair_sum / max(count, 1.0) for name, (pair_sum, count) in zip(pairs, total.tolist())})
        return {f"{prefix}{self.s.stats_prefix}{name}": values[name] for name in sorted(values)}

    @torch.no_grad()
    def validate(self) -> float | None:
        if self.val_loader is None:
            return None
        self.model.eval()
        saved = self.val_loader.state_dict()
        self.val_loader.epoch, self.val_loader.cursor = 0, 0  # the same rows every time
        num_batches = self.val_loader.batches_per_epoch
        if self.s.val_steps:
            num_batches = min(num_batches, self.s.val_steps)
        loss_sum = torch.zeros((), device=self.s.device)
        count = torch.zeros((), device=self.s.device)
        stat_sums: dict[str, torch.Tensor] = {}
        for _ in range(num_batches):
            batch = self.val_loader.next_batch()
            # One batch's own totals: validation reports per-unit means of each batch's sums.
            mb = self._micro_batch(batch, self.s.unit_counts(batch))
            batch_loss, batch_count, stats = self.runner.evaluate(mb, self.s.rows_loss)
            _add_stats(stat_sums, stats)
            loss_sum += batch_loss.float()
            count += batch_count
        self.val_loader.load_state_dict(saved)
        self.model.train()
        for root in self.runner.roots:  # the next training step must gather the weights afresh
            release_gathered(root)
        count = _all_reduce_sum(count).clamp_min(1)
        self.val_stats = self._stat_means(stat_sums, count, prefix="val_")
        return (_all_reduce_sum(loss_sum) / count).item()

    def validate_sources(self) -> dict[str, float]:
        """`validate` on each of `source_val_loaders`' rows: {val_loss/<name>: loss}; the last validation's
        statistics (val_stats) stay the run's own."""
        own_loader, own_stats, losses = self.val_loader, self.val_stats, {}
        try:
            for name, loader in self.s.source_val_loaders.items():
                self.val_loader = loader
                losses[f"val_loss/{name}"] = self.validate()
        finally:
            self.val_loader, self.val_stats = own_loader, own_stats
        return losses

    # -- throughput over the logging window ---------------------------------------------
    def _window_add(self, **amounts: float) -> None:
        for key, value in amounts.items():
            self._window[key] = self._window.get(key, 0.0) + value

    def _throughput(self, step_seconds: float) -> dict[str, Any]:
        """What the window since the last logged step measured: tokens/s with and without padding,
        model TFLOP/s and MFU per GPU, the last step's time, time waiting for data, peak memory.
        The window excludes validation and checkpoints; it starts after the step that compiles."""
        w = self._window
        seconds = max(w.get("seconds", 0.0), 1e-9)
        out: dict[str, Any] = {"tokens_per_s": w.get("tokens", 0.0) / seconds,
                               "tokens_per_s_no_padding": w.get("real_tokens", 0.0) / seconds,
                               "step_s": step_seconds, "data_wait_s": w.get("data_s", 0.0)}
        if self.s.step_flops is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            tflops = w.get("flops", 0.0) / seconds / world / 1e12  # per GPU
            out["tflops"] = tflops
            if self.s.peak_tflops:
                out["mfu"] = tflops / self.s.peak_tflops
        if self.s.device.type == "cuda":
            out["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.s.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.s.device)
        self._window = {}
        return out

    # -- loop -------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self._stop_reason = self._stop_reason or signal.Signals(signum).name

    def fit(self) -> TrainResult:
        # USR1: Slurm's time-limit warning. A SIGINT that this process was started with ignored (a
        # script's `cmd &`, as a shell without job control starts it; Python then installs no handler
        # either) stays ignored, as before training: a handler here would make the same signal stop
        # the run in its steps but not while it starts.
        stop_signals = [signal.SIGTERM, signal.SIGUSR1]
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            stop_signals.append(signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in stop_signals}
        losses: list[float] = []
        val_loss = None
        checkpoint = None
        last_record = None
        self._window: dict[str, float] = {}
        first_step, first_window, throughput = True, {}, {"tokens_per_s": 0.0}
        try:
            with StepProgress(self.s.progress, self.s.max_steps, self.step, self.s.log_every) as bar:
                while self.step < self.s.max_steps:
                    step_start = time.perf_counter()
                    record = self.train_step()
                    step_seconds = time.perf_counter() - step_start
                    self._window_add(seconds=step_seconds)
                    if first_step:  # compilation and warm-up: kept out of the window once another step is in
                        first_step = False
                        first_window, self._window = self._window, {}
                    losses.append(record["loss"])
                    if self.s.val_every and self.step % self.s.val_every == 0:
                        val_loss = self.validate()
                        record["val_loss"] = val_loss
                        record.update(self.val_stats)
                        record.update(self.validate_sources())
                    logged = self.step % self.s.log_every == 0 or self.step == self.s.max_steps or "val_loss" in record
                    if logged:
                        if not self._window:  # only the first step so far: it is all there is to report
                            self._window = first_window
                        throughput = self._throughput(step_seconds)
                        record.update(throughput)
                        if self.s.window_metrics is not None:
                            record.update(self.s.window_metrics())
                        self.metrics.write(record)
                    last_record = record
                    bar.update({**throughput, **record})
                    stop = self._stop_requested()
                    due = self.s.checkpoint_every and self.step % self.s.checkpoint_every == 0
                    at_end = self.s.save_at_end and self.step == self.s.max_steps
                    if stop or due or at_end:
                        checkpoint = self.save()
                    if stop:
                        self._acknowledge_stop(checkpoint)
                        break
        finally:
            self.checkpoints.wait()  # an asynchronous save becomes visible before we return
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return TrainResult(self.step, self._stop_reason is not None,
                           last_record["loss"] if last_record else None, val_loss, checkpoint, losses,
                           self.val_stats if val_loss is not None else {})

    def _stop_requested(self) -> bool:
        """A signal or the stop file may reach ranks at different steps: agree, so that all save together.

        Every rank looks for the stop file (one stat per step): on a shared filesystem some
        rank sees it first, and one is enough."""
        stop_file = self.s.stop_file
        if self._stop_reason is None and stop_file is not None and stop_file.exists():
            self._stop_reason = f"stop file {stop_file}"
        flag = torch.tensor(float(self._stop_reason is not None), device=self.s.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self._stop_reason is None:
            # Another rank saw the stop file (or a signal) first; the file may have appeared here
            # since this rank looked: name it when it is there, as the rank that saw it does.
            seen = stop_file is not None and stop_file.exists()
            self._stop_reason = f"stop file {stop_file}" if seen else "a stop request on another rank"
        return bool(flag.item())

    def _acknowledge_stop(self, checkpoint: str) -> None:
        """Once the stop's checkpoint is complete, rank 0 removes the stop file, then every rank returns.

        The removal is the acknowledgement the Slurm batch script waits for before it requeues
        (torchrun turns the ranks' exit status 130 into its own 1), and a requeued run must not
        stop again at once. No rank returns before it: torchrun kills the other workers as soon
        as one exits with a non-zero status."""
        self.checkpoints.wait()  # an asynchronous save becomes the complete checkpoint first
        distributed = dist.is_available() and dist.is_initialized()
        if self.s.stop_file is not None and (not distributed or dist.get_rank() == 0):
            self.s.stop_file.unlink(missing_ok=True)
        if distributed:
            dist.barrier()
        self._print(f"{self._stop_reason}: saved {checkpoint}; continue with --checkpoint.resume auto")

    def _print(self, message: str) -> None:
        if self.console is not None:
            self.console.print(message)
