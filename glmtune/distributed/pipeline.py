"""Pipeline parallelism: a model's stages on this pp rank, their schedule, and one step through it.

The model family's plan splits the model into stage modules (GLM-5's:
`glmtune/models/glm5/parallelize.py`'s `split_model`, with the split of
`pipeline_plan.py`) before the other transformations apply to its layers; `Pipeline`
then wraps each stage in a `torch.distributed.pipelining.PipelineStage` on the pp group
and runs the configured schedule:

    loss_sum, count = pipeline.train_step(mb)    # forward + backward of one micro batch
    loss_sum, count = pipeline.evaluate(mb)      # forward only (validation)

`mb` is the trainer's `MicroBatch` (`glmtune/models/common/microbatch.py`) of host tensors: the
pipeline cuts it into its microbatches (`row_slices`: whole rows, in order), each with its own
host facts, moves them to this rank's device and queues them for every stage of the rank, which
reads them in order (every schedule runs a stage's forwards in microbatch order); only the token
ids go through the schedule, to the first stage. This module is driven by the model family's
step runner (`glmtune/models/common/step_runner_pipelined.py`).

Another objective than next-token (preference pairs) passes a `token_loss`: the last stage calls it
with each microbatch's rows and their targets' log-probabilities and returns what it returns as the
loss sum.

Auxiliary losses (a multi-token-prediction loss on the last stage, an indexer KL every stage
computes over its own layers: stages built to run them) are sized by the micro batch's `aux`
(`models/common/aux_loss.AuxiliaryScales`: the step's totals over every rank, the one-process
factors); the stages add their (sum, count) pairs to their `statistics`, which `take_statistics`
sums over this rank's stages (summed over the ranks, they are one process's):

    loss_sum, count = pipeline.train_step(mb)
    stats = pipeline.take_statistics()                     # {"mtp_loss": tensor([sum, count])}

Loss: the last stage computes each microbatch's summed token loss and multiplies it
by the micro batch's `loss_scale` (1 / the step's supervised tokens over every rank): the schedule's
backward starts there, so gradients add up over microbatches, micro batches and ranks
exactly as in one process (schedules built with `scale_grads=False`). The loss sums
a rank reports are its own last stages' (0 elsewhere): summed over all ranks they are
the step's.

Activations between stages: `num_activations` tensors [mb, S, D] in the compute dtype
(hidden states; a model may add its own, e.g. GLM-5's next-token embeddings for its MTP
layer, each as many bytes again per boundary and microbatch, forward and backward). They are
floating point and carry gradients: the schedule moves them, and their gradients back. Their
shapes are given to each PipelineStage up front (static metadata), so no trial
microbatch runs before the first step. Every microbatch of a run has the same shape
(packed rows). A selection a stage may need from the previous one (GLM-5: the top-k
selection of a stage starting on a shared-indexer layer; a [mb, S, T] uint8 mask and a
uint8 [1] flag) does not go through the schedule (torch 2.11's stages mark every
received tensor as requiring a gradient, which a bool mask cannot): the sending stage
posts it on a process group of its own (`carry_group`, the pp ranks again) as its
forward runs, the receiving stage takes it at the start of its forward. Both run a
stage's microbatches in order, so the n-th message is the n-th microbatch's; stages on
one rank (V schedules) hand it over in memory.

Split backwards: the zero-bubble schedules (ZBVZeroBubble, InterleavedZeroBubble, and DualPipeV
outside its pairs) run a microbatch's backward as an input half (I: gradients of the stage's inputs,
the graph retained) and, later, a weight half (W: gradients of its weights from the gradients I
kept at every intermediate). Under activation checkpointing that costs twice: W unpacks the
checkpointed layers again and so recomputes them a second time (their expert all-to-alls too: on
the tiny model, 40.9 MB of all-to-all per step under DualPipeV and 88.1 under ZBVZeroBubble
against 25.2 under Interleaved1F1B), and every intermediate's gradient waits from I to W (sft_4k's
first rank under DualPipeV ran out of an H100's memory in its first W, 8 GiB above its plan). So a
model that recomputes passes `whole_backward`: each I action runs the whole backward, weights
included, and each W action has nothing left to do (torch's `dw_builder` hook) -- the schedule's
order is kept, the bubbles its W actions would have filled stay open.

Evaluation runs the stages in order with plain point-to-point sends (no backward,
no schedule): each stage's activations go to the next stage's rank.

The stage interface: a stage is an `nn.Module` (GLM-5's is `models/glm5/stages.py`'s
`Glm5Stage`); this module imports no model family and relies on these members only:

    is_first, is_last     bool: the stage takes the token ids [mb, T] / returns the scaled
                          loss sum of the microbatch, a [1] tensor (else its activations)
    num_activations       int: the [mb, S, D] tensors a stage passes the next one (the same for
                          every stage of the pipeline): positional outputs, then inputs
    carry_in, carry_out   bool: the stage receives / sends the selection above
    send_selection        set here: (mask uint8 [mb, S, T], flag uint8 [1]) -> None, called
                          by a `carry_out` stage during its forward
    receive_selection     set here: () -> (mask, flag), called by a `carry_in` stage
    backward_twice        set here: True under a zero-bubble schedule whose backward runs twice per
                          microbatch (input gradients, then weight gradients; not under
                          `whole_backward`): a function that forms its gradients at once keeps them
                          for the second call
    microbatches          list of `StageMicrobatch` (`glmtune/models/common/microbatch.py`): each
                          microbatch's rows on the device with their host facts (and the
                          `token_loss`, the last stage's loss of them), queued here one per
                          microbatch, consumed in order by the forward
    loss_sums             list of tensors: the last stage appends each microbatch's unscaled
                          loss sum; read and cleared here
    statistic_names       the auxiliary losses the stages report (the same names on every
                          stage, so that every rank reduces the same statistics)
    statistics            dict name -> (sum, count) [2] (fp32, or fp64): the stage that computes the
                          loss (the last stage; every stage for a per-layer loss) adds each
                          microbatch's; read and cleared here
    local_tokens(t_BT)    this rank's queries of a per-token tensor of the full rows ([B, T, ...]
                          -> [B, S, ...]; itself without context parallelism)
    forward(x, *activations)
                          x: ids or hidden states, then the other activations; the rest of the
                          microbatch (positions, documents, targets) is its queued rows

Legend: mb rows of a microbatch, S this rank's queries of a row, T tokens of a row, D model dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from glmtune.distributed import paired_overlap
from glmtune.distributed.pipeline_plan import stage_ids_for_rank
from glmtune.distributed.pipeline_stage import ReducingStage
from glmtune.models.common.microbatch import MicroBatch, StageMicrobatch


def _identity_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    # The last stage returns its scaled loss already (it needs the targets inside its FSDP unit),
    # as a [1] tensor: the schedule concatenates the last stage's outputs over microbatches.
    return output.sum()


def _splits_backward(schedule) -> bool:
    """Whether the schedule runs a stage's backward as input, then weight gradients (a W action:
    the zero-bubble schedules); single-stage schedules have no action list and run it whole."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(action is not None and action.computation_type == "W" for actions in order.values()
               for action in actions)


def _weights_done():
    # torch's `dw_builder`: with one, a stage's I action runs the full backward and keeps what this
    # returns for its W action; the weights' gradients are then already formed.
    return _nothing


def _nothing() -> None:
    return None


class Pipeline:
    """The schedule over this rank's stages (module docstring).

    Args:
        stages: this rank's stage modules (the stage interface of the module docstring),
            after FSDP2, which wraps each as a root unit.
        stage_ids: their indices in the pipeline; num_stages: the pipeline's stages.
        group: the pp process group; device: this rank's device.
        schedule: a `torch.distributed.pipelining` schedule name; microbatches per micro batch.
        micro_batch: rows per micro batch; seq_len: tokens per row; queries: this rank's
            queries per row (seq_len, or its slice under context parallelism).
        hidden_size, dtype: the activations' width and dtype.
        carry_group: a second group of the same pp ranks, for the carried top-k selections.
        ep_overlap: DualPipeV only: each paired forward and backward run side by side, taking turns
            at their expert all-to-alls (`paired_overlap`; the dispatchers must hand over).
        whole_backward: a split schedule's I actions run the whole backward and its W actions
            nothing (module docstring: for models that recompute in backward).
    """

    def __init__(self, stages: list[nn.Module], stage_ids: list[int], num_stages: int, group, device: torch.device,
                 schedule: str, microbatches: int, micro_batch: int, seq_len: int, queries: int, hidden_size: int,
                 dtype: torch.dtype, carry_group=None, ep_overlap: bool = False,
                 whole_backward: bool = False) -> None:
        from torch.distributed.pipelining.schedules import OVERLAP_F_B, PipelineScheduleSingle, get_schedule_class

        assert micro_batch % microbatches == 0, (micro_batch, microbatches)
        self.stages, self.stage_ids, self.num_stages = stages, stage_ids, num_stages
        self.group, self.device, self.microbatches = group, device, microbatches
        self.micro_batch = micro_batch  # rows: every micro batch has as many (the stages' shapes are fixed)
        rows = micro_batch // microbatches
        meta = torch.device("meta")
        # requires_grad: a stage sends its input's gradient back only for inputs that require it
        activations = tuple(torch.empty(rows, queries, hidden_size, dtype=dtype, device=meta, requires_grad=True)
                            for _ in range(stages[0].num_activations))
        self.pipeline_stages, self.input_metas = [], []
        self.schedule_name = schedule
        self._carry_shape = (rows, queries, seq_len)
        self._carry_group = carry_group
        self._pending: list = []  # (work, buffer) of posted sends, completed at the step's end
        self._in_memory: dict[int, list] = {}  # stage -> selections from a stage on this rank
        owner = self.owner = {}  # stage -> the pp rank that runs it
        for rank in range(dist.get_world_size(group)):
            for s in stage_ids_for_rank(schedule, rank, dist.get_world_size(group), len(stages)):
                owner[s] = rank
        for stage, index in zip(stages, stage_ids):
            if stage.carry_out:
                stage.send_selection = self._sender(index + 1, owner[index + 1])
            if stage.carry_in:
                stage.receive_selection = self._receiver(index, owner[index - 1])
            inputs = (torch.empty(rows, seq_len, dtype=torch.long, device=meta),) if stage.is_first else activations
            outputs = torch.empty(1, dtype=torch.float32, device=meta) if stage.is_last else activations
            self.input_metas.append(inputs)
            self.pipeline_stages.append(ReducingStage(stage, index, num_stages, device, input_args=inputs,
                                                      output_args=outputs, group=group,
                                                      dw_builder=_weights_done if whole_backward else None))
        schedule_class = get_schedule_class(schedule)
        single = issubclass(schedule_class, PipelineScheduleSingle)
        assert single == (len(stages) == 1), (schedule, len(stages))
        self.schedule = schedule_class(self.pipeline_stages[0] if single else self.pipeline_stages,
                                       n_microbatches=microbatches, loss_fn=_identity_loss, scale_grads=False)
        if ep_overlap:  # DualPipeV's paired forward and backward take turns at the expert all-to-alls
            assert schedule == "DualPipeV", schedule
            self.schedule.register_custom_function(OVERLAP_F_B, paired_overlap.overlap_f_b)
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        backward_twice = _splits_backward(self.schedule) and not whole_backward
        for stage in stages:
            stage.backward_twice = backward_twice

    # -- the carried top-k selection ------------------------------------------------------
    def _sender(self, next_stage: int, next_rank: int):
        def send(mask, flag):
            if next_rank == dist.get_rank(self.group):
                self._in_memory.setdefault(next_stage, []).append((mask, flag))
                return
            destination = dist.get_global_rank(self.group, next_rank)
            for tensor in (mask, flag):
                self._pending.append((dist.isend(tensor, destination, group=self._carry_group), tensor))
        return send

    def _receiver(self, stage: int, previous_rank: int):
        def receive():
            if previous_rank == dist.get_rank(self.group):
                return self._in_memory[stage].pop(0)
            source = dist.get_global_rank(self.group, previous_rank)
            mask = torch.empty(self._carry_shape, dtype=torch.uint8, device=self.device)
            flag = torch.empty(1, dtype=torch.uint8, device=self.device)
            dist.recv(mask, source, group=self._carry_group)
            dist.recv(flag, source, group=self._carry_group)
            return mask, flag
        return receive

    def _complete_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    # -- the microbatches ------------------------------------------------------------------
    def row_slices(self, num_rows: int) -> list[slice]:
        """The rows of each pipeline microbatch of a micro batch of `num_rows` rows: whole rows,
        in order (what a row holds, e.g. a preference pair, never splits across microbatches)."""
        assert num_rows % self.microbatches == 0, (num_rows, self.microbatches)
        rows = num_rows // self.microbatches
        return [slice(m * rows, (m + 1) * rows) for m in range(self.microbatches)]

    def _queue(self, mb: MicroBatch, token_loss=None) -> list[MicroBatch]:
        """Each pipeline microbatch's rows (host facts counted from the host tensors, then moved to
        this rank's device), queued for every stage of this rank; the rows, in order."""
        local = self.stages[0].local_tokens
        parts = [mb.rows(part, local).to(self.device) for part in self.row_slices(mb.input_ids.shape[0])]
        for stage in self.stages:
            stage.microbatches = [StageMicrobatch(rows, token_loss) for rows in parts]
            stage.loss_sums = []
            stage.statistics = {}
        return parts

    # -- steps ------------------------------------------------------------------------------
    def train_step(self, mb: MicroBatch, token_loss=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro batch (`MicroBatch` of host tensors; its `loss_scale` the
        last stage's factor, its `aux` the auxiliary losses'): (this rank's summed token loss, or the
        sum of `token_loss`'s results (module docstring); its supervised tokens; 0 without the last stage)."""
        parts = self._queue(mb, token_loss)
        count = sum(rows.num_supervised for rows in parts) if self.has_last else 0
        args = (mb.input_ids.to(self.device, non_blocking=True),) if self.has_first else ()
        # The loss needs no target of the schedule's (the last stage has the targets in its queued
        # microbatch); the schedule still splits one per microbatch.
        target = torch.zeros(mb.input_ids.shape[0], device=self.device) if self.has_last else None
        self.schedule.step(*args, target=target)
        self._complete_sends()
        return self._loss_sum(), torch.tensor(count, dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def evaluate(self, mb: MicroBatch, token_loss=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward only: (this rank's summed token loss, its supervised tokens; 0 without the last stage);
        with `token_loss`, the sum of its results as the loss (module docstring)."""
        local = self.stages[0].local_tokens
        parts = self._queue(mb, token_loss)
        pp_rank = dist.get_rank(self.group)
        owner = self.owner
        count = torch.zeros((), dtype=torch.int64, device=self.device)
        for part, rows in zip(self.row_slices(mb.input_ids.shape[0]), parts):
            carried: tuple = ()
            for index in range(self.num_stages):
                if owner[index] != pp_rank:
                    continue
                position = self.stage_ids.index(index)
                stage = self.stages[position]
                if stage.is_first:
                    inputs = (mb.input_ids[part].to(self.device),)
                elif owner[index - 1] == pp_rank:
                    inputs = carried
                else:
                    inputs = tuple(self._recv_like(t, owner[index - 1]) for t in self.input_metas[position])
                out = stage(*inputs)
                if stage.is_last:
                    count += (local(rows.targets) != -100).sum()
                    continue
                carried = out if isinstance(out, tuple) else (out,)
                if owner[index + 1] != pp_rank:
                    for tensor in carried:
                        dist.send(tensor.contiguous(), dist.get_global_rank(self.group, owner[index + 1]),
                                  group=self.group)
        self._complete_sends()
        return self._loss_sum(), count

    def _recv_like(self, meta: torch.Tensor, source: int) -> torch.Tensor:
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        dist.recv(buffer, dist.get_global_rank(self.group, source), group=self.group)
        return buffer

    def take_statistics(self) -> dict[str, torch.Tensor]:
        """This rank's stages' auxiliary-loss statistics since the last call: name -> (sum, count)
        [2] (fp32, or the stages' own wider dtype), zeros on a rank whose stages report none (every
        rank names the same ones)."""
        totals = {name: torch.zeros(2, dtype=torch.float32, device=self.device)
                  for name in self.stages[0].statistic_names}
        for stage in self.stages:
            for name, value in stage.statistics.items():
                totals[name] = totals[name] + value  # an fp64 count stays exact
            stage.statistics = {}
        return totals

    def _loss_sum(self) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for stage in self.stages:
            for value in stage.loss_sums:
                total += value
            stage.loss_sums = []
        return total

