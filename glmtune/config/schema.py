"""The job configuration: one typed dataclass tree, filled from YAML by `loader.py`.

Every field has a default and a one-line comment; the defaults describe a
single-process run of the `tiny` preset, so a recipe only states what it changes
(at least where the data comes from). Semantic checks that
span fields (parallel degrees, batch divisibility, warmup vs steps) live in
`validate.py`; this file only declares shapes, types and defaults.

Conventions the loader relies on:
- Field types are restricted to int, float, bool, str, `X | None`, `Literal`,
  `list[X]`, `tuple[...]`, `dict[str, X]`, `Any` and nested dataclasses.
- Choices are `Literal`s of strings that YAML 1.1 does not read as booleans
  (no bare `on`/`off`/`yes`/`no`), so an unquoted value stays a string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

# torch.distributed.pipelining schedule names, spelled as `get_schedule_class` accepts them.
PipelineSchedule = Literal[
    "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
]


@dataclass
class ModelConfig:
    """Which model to build and how its kernels run."""

    name_or_path: str = "tiny"  # a preset (tiny|glm5|glm5.1|glm5.2|glm5.3) or a local HF directory with config.json
    # the model family that trains it (glmtune/models/catalog.py): auto = a preset's, or an HF directory's by its
    # config.json model_type (a native family's, else "hf": any causal LM transformers implements); or a family name
    family: str = "auto"
    dtype: Literal["float32", "bfloat16"] = "bfloat16"  # compute dtype; parameters too unless train.master_weights
    overrides: dict[str, Any] = field(default_factory=dict)  # model-config fields to replace, e.g. num_hidden_layers
    # auto: triton on GPU, sdpa on CPU; absorbed: MLA's absorbed (MQA) form over the selected keys only,
    # absorbed_triton: the same through fused Triton kernels (CUDA, bf16/fp16)
    attention_backend: Literal["auto", "sdpa", "eager", "flex", "gemm", "triton", "absorbed",
                               "absorbed_triton"] = "auto"
    moe_backend: Literal["grouped_mm", "loop"] = "grouped_mm"  # routed experts: torch._grouped_mm or a per-expert loop
    moe_dispatch_backend: Literal["auto", "torch", "triton"] = "auto"  # token movement; auto: triton on cuda
    indexer_backend: Literal["auto", "chunked", "reference", "fused"] = "auto"  # DSA scores; auto: fused on cuda
    # RMSNorm: torch, the eager function (the reference); triton, one forward and one backward kernel
    # with its roundings (CUDA), which save the input and 1/rms instead of an fp32 copy; auto: triton on cuda
    norm_backend: Literal["auto", "torch", "triton"] = "auto"
    # triton attention backward: dQ / dV as GEMMs over bf16 dS / P while each fits (0: never);
    # absorbed_triton: its backward's P / dS buffers, filled chunk of queries by chunk (0: one query at a time)
    attention_score_buffer_mib: int = 1024
    # keep the frozen base in FP8 (e4m3, 128x128 block scales, as GLM-5's FP8 checkpoints store it; LoRA
    # only, an HF directory): dequant = each layer's weight dequantized into a
    # transient for a bf16 GEMM (docs/benchmarks.md); triton = GEMMs that read the e4m3 weight and
    # dequantize each tile on chip, the same operands (CUDA; widths not multiples of 128 dequantize;
    # faster below ~400 rows per expert, slower above: docs/lora.md);
    # none = FP8 checkpoints are dequantized on load
    fp8_base: Literal["none", "dequant", "triton"] = "none"
    # train the DSA indexers (the MTP layer's included) with their KL loss (train.indexer_loss_weight > 0);
    # false: frozen, as transformers and the released checkpoints leave them (docs/auxiliary-losses.md)
    indexer_trainable: bool = False
    validate_as: str | None = None  # a preset whose dims `config validate` uses when name_or_path is not readable


@dataclass
class SyntheticDataConfig:
    """Generated data, so a run needs no files (the tiny default uses it)."""

    # support_tickets: ticket -> JSON answer (chat rows); support_preferences: the same prompts with the
    # reference answer chosen over a plausible wrong one (preference rows, train.objective: dpo)
    kind: Literal["support_tickets", "support_preferences"] = "support_tickets"
    rows: int = 2000  # number of conversations to generate
    seed: int = 0  # generator seed, independent of train.seed


@dataclass
class ReplayConfig:
    """General data mixed into the run's own (`data.replay`): a share of the target tokens, so a continued
    pretraining or fine-tuning run keeps general capability while it shifts the distribution
    (docs/data.md "Replay mix"). Prepared with the data section's keys of its kind; one tokenizer for both."""

    kind: Literal["chat", "text"] = "chat"  # chat rows through the template, or raw documents
    train: list[str] = field(default_factory=list)  # its files (or folders, kind text)
    validation: list[str] = field(default_factory=list)  # its validation files; empty = carve with data.split
    synthetic: SyntheticDataConfig | None = None  # kind chat: generated support tickets (the bundled tiny data)
    weight: float = 0.2  # its share of the training target tokens, in (0, 1); the run's own data gets the rest


@dataclass
class DataConfig:
    """Where conversations come from and how they become packed token rows."""

    train: list[str] = field(default_factory=list)  # training files or HF dataset ids
    validation: list[str] = field(default_factory=list)  # validation files; empty = carve from train with `split`
    format: Literal["auto", "jsonl", "parquet", "hf_datasets"] = "auto"  # auto = by file extension
    synthetic: SyntheticDataConfig | None = None  # generate data instead of (or besides) reading `train`
    chat_template: str | None = None  # Jinja template path; null = the tokenizer's own, else the bundled GLM-5 one
    tokenizer: str | None = None  # tokenizer directory; null = the model directory's, or the bundled tiny one
    loss_on: Literal["all_assistant", "last_assistant"] = "all_assistant"  # which assistant turns carry loss
    enable_thinking: bool = False  # render <think> blocks (GLM-5 reasoning) into the training text
    packed_sequence_size: int = 4096  # tokens per packed row
    too_long: Literal["truncate", "drop"] = "drop"  # a conversation longer than a row: cut it or skip it
    json_schema: str | None = None  # JSON schema the assistant answers must satisfy (checked at load and eval)
    cache_dir: str | None = None  # tokenized-data cache; null = $GLMTUNE_CACHE_DIR or ~/.cache/glmtune (tokenized/)
    # Ratios (train/validation/test) carved from `train`, used only when `validation` is empty.
    split: dict[str, float] = field(default_factory=lambda: {"train": 0.98, "validation": 0.02})
    pii: Literal["report", "drop", "fail"] = "report"  # what to do with rows that look like they contain PII
    # chat: conversations through the chat template (the keys above); text: raw documents for continued
    # pretraining: every token a target, EOS after each document, no template (docs/data.md "Raw text")
    kind: Literal["chat", "text"] = "chat"
    text_field: str = "text"  # kind text: the JSONL key / Parquet column holding a document
    text_separator: str | None = None  # kind text, .txt/.md files: null = one document per file, else split on it
    source_field: str | None = None  # kind text: the key / column naming a document's source; null = its file
    min_document_tokens: int = 1  # kind text: a document with fewer tokens (EOS not counted) is removed
    max_document_tokens: int | None = None  # kind text: a document with more tokens is removed; null = no limit
    # kind text: a document longer than a packed row: split into chunks of the row's length, cut to it, or skipped
    long_documents: Literal["split", "truncate", "drop"] = "split"
    long_document_overlap: int = 0  # kind text, split: tokens a chunk repeats from the previous one, as context only
    # general data mixed in by target tokens against forgetting (ReplayConfig); null = the run's own data only
    replay: ReplayConfig | None = None


@dataclass
class TrainConfig:
    """The optimisation loop. The number of accumulation steps is derived, not set."""

    max_steps: int = 100  # optimizer steps
    global_batch_size: int = 32  # packed rows per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 1  # packed rows per rank per forward/backward
    seed: int = 1234  # model init, data order and dropout
    val_every: int = 50  # validate every N steps; 0 = never
    val_steps: int | None = 10  # validation batches per evaluation; null = the whole validation set
    log_every: int = 10  # print/log metrics every N steps
    clip_grad_norm: float | None = 1.0  # max global grad norm; null = no clipping
    router_bias_update: Literal["none", "sign"] = "none"  # aux-loss-free balancing: bias += rate*sign(mean-load); off for SFT
    router_bias_update_rate: float = 1e-3  # step size of the router bias update
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda when available
    # fp32: AdamW updates fp32 parameters; layers compute in model.dtype on bf16 copies (FSDP2 mixed precision,
    # one process included; gradients reduced in fp32). none: parameters in model.dtype (bf16-only: the one-GPU
    # fast path, warned at start). auto: fp32 for full fine-tuning with model.dtype bfloat16, none otherwise.
    master_weights: Literal["auto", "fp32", "none"] = "auto"
    generate_samples: int = 0  # held-out prompts answered greedily before and after training, scored (3 printed)
    # sft: next-token loss on the assistant turns; dpo: preference optimization on prompt/chosen/rejected
    # rows (the `dpo` section; docs/preference.md); distill: SFT's loss on a teacher's answers plus a KL to its
    # top-K log-probabilities (the `distill` section; docs/distill.md)
    objective: Literal["sft", "dpo", "distill"] = "sft"
    # GLM-5's multi-token-prediction layer predicts token t+2 from the model's state at t and the
    # embedding of t+1 (what serving engines draft with); its loss, averaged over its own supervised
    # tokens, is added with this weight and the MTP layer trains (0: frozen, no loss). docs/auxiliary-losses.md
    mtp_loss_weight: float = 0.0
    # weight of the DSA indexers' KL loss (their scores against the main attention over the selected keys,
    # both sides detached from the main model); needs model.indexer_trainable: true
    indexer_loss_weight: float = 0.0
    # first N steps: dense attention and only the indexers train, against the dense attention (DeepSeek-V3.2's
    # warm-up, for long-context adaptation); needs the indexer loss
    indexer_warmup_steps: int = 0


@dataclass
class OptimConfig:
    """AdamW (torch.optim.AdamW, or glmtune's Triton kernel: `fused`) and the learning-rate schedule."""

    lr: float = 1e-5  # peak learning rate
    weight_decay: float = 0.0  # decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # Adam moment decay rates
    eps: float = 1e-8  # Adam denominator epsilon
    fused: bool | Literal["auto", "triton"] = "auto"  # fused AdamW kernel; auto = torch's on cuda; triton = glmtune's
    scheduler: Literal["cosine", "constant", "linear"] = "cosine"  # decay after warmup
    warmup_steps: int = 0  # linear warmup from 0 to lr over N steps; > 0 takes precedence over warmup_ratio
    # the warm-up as a fraction of train.max_steps, ceil(ratio x max_steps) steps (transformers' rule), so a
    # shorter run (--train.max_steps 10) warms up in proportion; used while warmup_steps is 0
    warmup_ratio: float | None = None
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine/linear)

    def warmup_steps_for(self, max_steps: int) -> int:
        """The warm-up in optimizer steps of a run of `max_steps`: warmup_steps when set, else the ratio's."""
        if self.warmup_steps > 0 or self.warmup_ratio is None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * max_steps)


@dataclass
class DpoConfig:
    """Preference optimization (`train.objective: dpo`); formulas and sources in docs/preference.md."""

    beta: float = 0.1  # strength of the implicit KL to the reference (DPO's beta)
    loss: Literal["sigmoid", "ipo", "robust"] = "sigmoid"  # DPO, IPO (per-token averaged), robust DPO
    label_smoothing: float = 0.0  # assumed share of flipped preferences (sigmoid: cDPO; robust: its epsilon)
    sft_weight: float = 0.0  # weight of the chosen answers' next-token loss added to the preference loss (RPO)
    # model: the starting model (LoRA: the same weights with the adapters off; full fine-tuning:
    # log-probabilities computed once before training and cached); none: reference-free (SimPO)
    reference: Literal["model", "none"] = "model"
    simpo_gamma: float = 0.5  # SimPO's target reward margin (reference: none only)


@dataclass
class DistillConfig:
    """Distillation (`train.objective: distill`) from a teacher directory (`glmtune distill generate`'s,
    named by data.train); the losses and their choices in docs/distill.md."""

    # λ: weight of the KL between the teacher's top-K distribution (the rest of its mass as one bucket) and
    # the student's, beside the cross-entropy on the teacher's tokens; 0: sequence-level only (no log-probs read)
    weight: float = 1.0
    temperature: float = 1.0  # both distributions softened by it; the KL is multiplied by its square


@dataclass
class CheckpointConfig:
    """Saving, retention and resume."""

    dir: str | None = None  # null = <logging.run_dir>/checkpoints
    every_steps: int = 0  # save every N steps; 0 = only at the end (see save_at_end)
    keep_last: int = 2  # checkpoints kept on disk; 0 = keep all
    resume: str = "none"  # none | auto (latest in dir, if any) | a checkpoint path
    export_hf: bool = False  # also write an HF-loadable model (or PEFT adapter) at the end
    async_save: bool = False  # write checkpoints in the background
    # false: no checkpoint after the last step (throughput probes); the trained weights are kept
    # only by checkpoint.export_hf (or LoRA's adapters) or an earlier every_steps checkpoint
    save_at_end: bool = True


@dataclass
class ParallelConfig:
    """Device mesh degrees and launch topology.

    The mesh is dp_replicate x dp_shard x cp x tp x pp; expert parallelism does not
    add ranks, it is carved out of dp_shard x cp (see `validate.validate_parallel`).
    """

    world_size: int | None = None  # null = from the launcher (WORLD_SIZE) or nodes x gpus_per_node
    dp_shard: int = -1  # FSDP2 sharding degree; -1 = whatever the other degrees leave
    dp_replicate: int = 1  # HSDP replica groups
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline stages (ranks)
    ep: int = 1  # expert parallel; must divide dp_shard x cp and the number of experts
    cp: int = 1  # context parallel (packed rows are split along the sequence)
    cp_balance: Literal["head_tail", "contiguous"] = "head_tail"  # queries per cp rank: head_tail = equal causal work
    ep_dispatcher: Literal["all_to_all", "all_gather"] = "all_to_all"  # EP token movement; all_gather: the simple reference
    # EP: each MoE layer's tokens in N chunks, each chunk's rows travelling while another chunk's experts
    # compute (docs/distributed.md, "What hides the expert all-to-all"); > 1 needs ep > 1 and all_to_all
    ep_overlap_chunks: int = 1
    # EP under full activation checkpointing: the all-to-alls whose received rows the forward keeps, so the
    # recomputation does not exchange them again (docs/distributed.md): none; combine (this rank's token-expert
    # pairs x hidden x 2 B per MoE layer and micro-batch in flight); dispatch (as many rows, received for this
    # rank's experts; no count exchange or host sync either); both (twice that: the recomputation sends nothing);
    # counts (the dispatch's per-expert counts alone, a few bytes: no count exchange and no host sync in the
    # recomputation, whose rows are exchanged again)
    ep_keep_exchanges: Literal["none", "counts", "combine", "dispatch", "both"] = "none"
    pp_schedule: PipelineSchedule = "1F1B"  # torch.distributed.pipelining schedule
    pp_microbatches: int | None = None  # pipeline microbatches per micro batch; null = one row each
    pp_stages_per_rank: int = 1  # virtual stages per pp rank (>1 needs a multi-stage schedule)
    pp_layer_split: list[int] = field(default_factory=list)  # decoder layers per stage; empty = balanced by cost
    # DualPipeV with EP: each paired forward and backward run side by side, one's expert all-to-alls travelling
    # while the other computes (docs/distributed.md); needs ep > 1, all_to_all and compile: false
    pp_ep_overlap: bool = False
    # recompute layers in backward; "selective" keeps top-k masks, attention and wide matmul outputs
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    ac_keep_matmul_min_k: int = 4096  # selective AC keeps matmul outputs whose reduction dim is >= this
    compile: bool = False  # torch.compile each decoder layer
    launcher: Literal["torchrun", "slurm"] = "torchrun"  # how `glmtune train` starts processes
    nodes: int | None = None  # number of hosts; with gpus_per_node fixes world_size
    gpus_per_node: int | None = None  # processes per host


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning. method none = full fine-tuning."""

    method: Literal["none", "lora"] = "none"  # adapter type
    rank: int = 32  # LoRA rank r
    alpha: float = 64.0  # LoRA scale numerator: scale = alpha/r (alpha/sqrt(r) with rslora)
    dropout: float = 0.0  # dropout on the LoRA input
    rslora: bool = False  # rank-stabilised scaling alpha/sqrt(r)
    # fnmatch globs over module names (HF names, e.g. model.layers.3.self_attn.q_a_proj); null = the model
    # family's default (GLM-5: NVIDIA's list less kv_b_proj; hf: every Linear of attention and MLP, stacked
    # experts included), resolved when LoRA is applied and recorded in the run's trainable.json (docs/lora.md)
    target_modules: list[str] | None = None
    exclude_modules: list[str] = field(default_factory=list)  # globs removed from the matches
    # fp32 adapters; their products in the base's dtype (base: bf16 GEMMs, the fast path) or in fp32 (PEFT's way)
    adapter_compute: Literal["base", "fp32"] = "base"
    # the routed experts' base + update sums: triton (one fused pass) or torch; auto: triton on cuda
    adapter_kernel: Literal["auto", "torch", "triton"] = "auto"


@dataclass
class LoggingConfig:
    """Where run artefacts and metrics go."""

    run_dir: str | None = None  # null = runs/<name>; holds config.yaml, metrics and checkpoints
    tensorboard: bool = True  # write TensorBoard events under <run_dir>/tensorboard
    wandb: str | None = None  # Weights & Biases project; null = off
    # MLflow tracking URI (file:///abs/mlruns: a local store, no server; http://host:5000); experiment and
    # run named after `name`; params: the resolved config; metrics: every step record. null = off
    mlflow: str | None = None
    metrics_file: str = "metrics.jsonl"  # one JSON object per logged step, relative to run_dir
    progress: bool = True  # live progress bar on rank 0


@dataclass
class JobConfig:
    """Everything one glmtune run needs; saved resolved as <run_dir>/config.yaml."""

    name: str = "glmtune"  # run name; also names the default run_dir
    description: str = ""  # free text kept with the run
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
