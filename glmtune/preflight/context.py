"""What one preflight works on: the user's run, and the small scratch runs that stand in for it.

`Preflight` holds the recipe as the user's `glmtune train` would resolve it (recipe + dotted
overrides: `cfg`), the output directory, and the scratch configuration that checks 5-10 run:
the same recipe with
  * the model an HF directory's first K decoder layers with their real weights (the model
    spec's `truncated_view`; `--layers auto` takes the fewest layers holding every kind of
    layer the model has), a GLM-5-sized preset's first K layers, or a small preset (tiny) as it is;
    a family that writes no such view (the hf family) trains a directory's model whole when it is
    small (up to 1B parameters), and `--layers auto` refuses a larger one;
  * the first `rows` conversations of the data (`data.train` files copied to
    OUT/work/data/, or `data.synthetic.rows` lowered), through the recipe's own pipeline;
  * two optimizer steps of the scaled-down layout's global batch (`layout.py`) in one
    process, the recipe's sequence length, dtype, precision, LoRA and kernel settings;
  * no validation runs, samples, TensorBoard or progress bar; checkpoints only where a
    check asks for one; the tokenization cache under OUT/work/cache.
The scratch configuration is written resolved to OUT/work/config.yaml; every scratch run
(in this process or a fresh one) loads that file with its own run directory. The model is
reached through its family's spec (`glmtune.models.registry`: `Preflight.spec`).
"""

from __future__ import annotations

import itertools
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from glmtune.config import JobConfig, dump_config, load_config, resolve_recipe_path
from glmtune.config.degrees import raise_config_errors
from glmtune.config.validate import device_errors
from glmtune.data.sources import read_rows
from glmtune.data.text_run_data import corpus_options
from glmtune.data.text_sources import read_documents
from glmtune.models.common.model_spec import ModelSpec
from glmtune.models.registry import is_preset, model_args, model_spec
from glmtune.preflight.layout import ONE_PROCESS, Replica, UNPINNED_TOPOLOGY, scaled_replica
from glmtune.train.model_source import tokenizer_dir_for
from glmtune.train.process import resolve_device
from glmtune.train.run_data import PreparedData, prepare_data

NUM_STEPS = 2  # the reference run's optimizer steps; the resume check saves after the first
AUTO_TRUNCATE_PARAMS = 10**9  # `--layers auto` keeps a preset below this whole (tiny); GLM-5 sizes are cut


def _num_params(spec: ModelSpec, args: Any) -> int:
    return sum(p.numel() for p in spec.weights.build(args, device="meta").parameters())


class Preflight:
    """The user's run (`cfg`) and the scratch runs of checks 5-10 (`scratch`).

    Args:
        recipe: a recipe path or a name under recipes/.
        overrides: dotted overrides, as `glmtune train` takes them.
        out: the report's directory; scratch runs go under OUT/work.
        layers: "auto", "all" or a number of decoder layers for checks 5-10; auto: an HF directory's
            or a preset of 1B parameters or more's fewest leading layers that hold every kind of layer
            (the spec's `covering_layers`), a smaller preset whole.
        nproc: processes of the multi-process check (None: the GPUs of this host, 2 on CPU).
        rows: conversations of the data the scratch runs read.
    """

    def __init__(self, recipe: str | Path, overrides: list[str], out: str | Path, *, layers: str | int = "auto",
                 nproc: int | None = None, rows: int = 64) -> None:
        self.recipe = resolve_recipe_path(recipe)
        self.overrides = list(overrides)
        self.cfg = load_config(self.recipe, self.overrides)
        self.out = Path(out)
        self.layers = layers
        self.rows = rows
        self.device = resolve_device(self.cfg.train.device)
        raise_config_errors(device_errors(self.cfg, self.device.type))  # before any scratch run starts
        self.nproc = nproc or (torch.cuda.device_count() if self.device.type == "cuda" else 2)
        name = self.cfg.model.name_or_path
        self.model_dir = None if is_preset(name) else Path(name)
        self.replica: Replica = scaled_replica(self.cfg.parallel, self.nproc, accumulation=1,
                                               micro_batch_size=2 if self.cfg.parallel.pp > 1 else 1)
        self._scratch: JobConfig | None = None
        self._data: PreparedData | None = None
        self._layers: list[int | None] = []  # scratch_layers(), once known
        self.notes: list[str] = []  # how the scratch runs differ from the user's run
        if isinstance(layers, int):  # a user error, refused before anything runs
            try:
                total = self.spec.architecture.num_layers(model_args(self.cfg.model))
            except (OSError, ValueError):
                total = layers  # an unreadable config: checks 1-4 say so
            if layers > total:
                raise ValueError(f"--layers {layers}: {self.cfg.model.name_or_path} has {total} decoder layers")
            if layers < total and self.model_dir is not None and not self.spec.weights.truncated_views:
                raise ValueError(f"--layers {layers}: a view of a checkpoint's first layers is not available for "
                                 f"the {self.spec.family.name} family; use --layers all (or auto)")

    @cached_property
    def spec(self) -> ModelSpec:
        """The front door of the recipe's model family (its scratch model's too)."""
        return model_spec(self.cfg.model)

    @property
    def lora(self) -> bool:
        return self.cfg.peft.method == "lora"

    @property
    def work(self) -> Path:
        """Where the scratch runs write: OUT/work."""
        return self.out / "work"

    @property
    def scratch_yaml(self) -> Path:
        return self.work / "config.yaml"

    @property
    def has_scratch(self) -> bool:
        """Whether the scratch configuration was built (checks 5-10 were reached)."""
        return self._scratch is not None

    # -- the scratch configuration ----------------------------------------------------------
    def scratch_layers(self) -> int | None:
        """Decoder layers of the scratch model, None for the model as it is."""
        if not self._layers:
            args = model_args(self.cfg.model)
            total = self.spec.architecture.num_layers(args)
            if self.layers == "all":
                wanted = total
            elif self.layers == "auto":
                wanted = total if self._whole_when_auto(args) else self.spec.architecture.covering_layers(args)
            else:
                wanted = int(self.layers)
            self._layers.append(wanted if wanted < total else None)
        return self._layers[0]

    def _whole_when_auto(self, args: Any) -> bool:
        """`--layers auto` trains a small preset whole and views an HF directory's or a large preset's first
        layers; a family that writes no view (`Weights.truncated_views`) trains a small directory whole,
        and a large one is refused: its steps could not run here."""
        if self.model_dir is None:
            return _num_params(self.spec, args) <= AUTO_TRUNCATE_PARAMS
        if self.spec.weights.truncated_views:
            return False
        count = _num_params(self.spec, args)
        if count > AUTO_TRUNCATE_PARAMS:
            raise ValueError(f"{self.model_dir}: a view of its first layers is not available for the "
                             f"{self.spec.family.name} family, and its {count:,} parameters are more than checks 5-10 "
                             f"step whole (--layers auto keeps {AUTO_TRUNCATE_PARAMS:,}); --layers all tries the "
                             "whole model")
        return True

    def scratch(self) -> JobConfig:
        """The scratch configuration (written to OUT/work/config.yaml on first use)."""
        if self._scratch is None:
            self.work.mkdir(parents=True, exist_ok=True)
            cfg = load_config(self.recipe, [*self.overrides, *self._scratch_overrides()])
            dump_config(cfg, self.scratch_yaml)
            self._scratch = cfg
        return self._scratch

    def _scratch_overrides(self) -> list[str]:
        o = self.cfg.optim
        out = [*UNPINNED_TOPOLOGY, *ONE_PROCESS, *self.replica.batch,
               "--train.max_steps", str(NUM_STEPS), "--optim.warmup_steps", str(min(o.warmup_steps, NUM_STEPS)),
               "--checkpoint.every_steps", "0", "--checkpoint.keep_last", "0", "--checkpoint.resume", "none",
               "--checkpoint.export_hf", "false", "--train.val_every", "0", "--train.val_steps", "1",
               "--train.generate_samples", "0", "--train.log_every", "1", "--logging.progress", "false",
               "--logging.tensorboard", "false", "--logging.wandb", "null",
               "--data.cache_dir", str(self.work / "cache")]
        self.notes = [f"{NUM_STEPS} optimizer steps of {self.replica.batch[-1]} rows (the scaled layout's global "
                      f"batch; micro batch {self.replica.batch[1]}) instead of the recipe's "
                      f"{self.cfg.train.max_steps} x {self.cfg.train.global_batch_size}"]
        layers = self.scratch_layers()
        if layers is not None and self.model_dir is not None:
            view = self.spec.weights.truncated_view(self.model_dir, self.work / f"model-first-{layers}-layers", layers)
            out += ["--model.name_or_path", str(view.resolve())]
            self.notes.append(f"the first {layers} decoder layers of {self.model_dir} with their real weights "
                              f"(a view: {view}); MTP layers and the layers after {layers} are not loaded")
        elif layers is not None:
            for key, value in self.spec.architecture.truncated_overrides(model_args(self.cfg.model), layers).items():
                out += [f"--model.overrides.{key}", json.dumps(value)]
            self.notes.append(f"the first {layers} decoder layers of the {self.cfg.model.name_or_path} preset")
        return out + self._data_overrides()

    def _data_overrides(self) -> list[str]:
        """The first `rows` conversations of the recipe's data, read by its own pipeline."""
        d, out = self.cfg.data, []
        if d.kind == "text":
            return self._text_overrides()
        if d.synthetic is not None and d.synthetic.rows > self.rows:
            out += ["--data.synthetic.rows", str(self.rows)]
            self.notes.append(f"{self.rows} of the recipe's {d.synthetic.rows} generated conversations")
        for split, paths in (("train", d.train), ("validation", d.validation)):
            if not paths:
                continue
            subset = self.work / "data" / f"{split}-first-{self.rows}.jsonl"
            subset.parent.mkdir(parents=True, exist_ok=True)
            lines = []
            for row in itertools.islice(read_rows(paths), self.rows):
                if row.parse_error:
                    raise ValueError(f"data.{split}: {row.origin}: {row.parse_error}")
                lines.append(json.dumps(row.data, ensure_ascii=False) + "\n")
            subset.write_text("".join(lines), encoding="utf-8")
            out += [f"--data.{split}", json.dumps([str(subset.resolve())]), "--data.format", "auto"]
            self.notes.append(f"the first {len(lines)} conversations of data.{split} ({', '.join(paths)}), "
                              f"copied to {subset}")
        return out

    def _text_overrides(self) -> list[str]:
        """data.kind text: the first `rows` documents of each split's files, read by the recipe's
        reader, copied to one JSONL that keeps each document's source (the split's unit)."""
        d, out = self.cfg.data, []
        source_field = d.source_field or ("source" if d.text_field != "source" else "source_file")
        for split, paths in (("train", d.train), ("validation", d.validation)):
            if not paths:
                continue
            subset = self.work / "data" / f"{split}-first-{self.rows}.jsonl"
            subset.parent.mkdir(parents=True, exist_ok=True)
            docs = itertools.islice(read_documents(paths, corpus_options(self.cfg, (1.0, 0.0, 0.0)).read), self.rows)
            lines = [json.dumps({d.text_field: doc.text, source_field: doc.source}, ensure_ascii=False) + "\n"
                     for doc in docs]
            subset.write_text("".join(lines), encoding="utf-8")
            out += [f"--data.{split}", json.dumps([str(subset.resolve())])]
            self.notes.append(f"the first {len(lines)} documents of data.{split} ({', '.join(paths)}), "
                              f"copied to {subset}")
        return out + ["--data.format", "auto", "--data.source_field", source_field]

    def scratch_model_dir(self) -> Path | None:
        """The HF directory the scratch model reads (the view, or the model's own), None for a preset."""
        return None if self.model_dir is None else Path(self.scratch().model.name_or_path)

    def data(self) -> PreparedData:
        """The scratch runs' rows, prepared by the recipe's pipeline again (OUT/work/rows; cached)."""
        if self._data is None:
            cfg = self.scratch()
            self._data = prepare_data(cfg, self.work / "rows", tokenizer_dir_for(cfg, self.scratch_model_dir()),
                                      self.spec.architecture.vocab_size(model_args(cfg.model)))
        return self._data

    # -- scratch runs ---------------------------------------------------------------------
    def train_args(self, run_dir: Path, *extra: str) -> list[str]:
        """`glmtune train` arguments of one scratch run in `run_dir`."""
        return [str(self.scratch_yaml), "--logging.run_dir", str(run_dir), "--checkpoint.dir",
                str(run_dir / "checkpoints"), *extra]

    def run_config(self, run_dir: Path, *extra: str) -> JobConfig:
        """The configuration of one scratch run in `run_dir`, as its `glmtune train` would load it."""
        self.scratch()
        return load_config(self.train_args(run_dir)[0], self.train_args(run_dir, *extra)[1:])

    def env(self, nproc: int = 1) -> dict[str, str]:
        """The environment of a scratch run's processes: this process's CPU threads shared among
        them (the same count as here for one process, so that its float sums run in the same order
        as the in-process reference run's), nothing downloaded, no torchrun variables inherited."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        threads = max(1, torch.get_num_threads() // nproc)
        return {**env, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

    def describe_model(self) -> str:
        """What checks 5-10 train: the model and, for a view, which part of it."""
        layers = self.scratch_layers()
        where = self.cfg.model.name_or_path
        if layers is None:
            return f"{where} (all layers)"
        return f"the first {layers} decoder layers of {where}" + (" (real weights)" if self.model_dir else "")

    def tolerance(self) -> tuple[float, str]:
        """(relative tolerance, why) for the losses of two one-process runs that should be equal: 0 on
        the CPU in float32, where the same operations in the same order give the same bits; 1e-3 in
        bfloat16 or on CUDA, whose kernels may sum in another order from run to run (a bound chosen,
        not yet measured on a GPU: docs/preflight.md)."""
        if self.device.type == "cpu" and self.cfg.model.dtype == "float32":
            return 0.0, "exact: CPU, float32"
        return 1e-3, f"relative 1e-3: {self.device.type}, {self.cfg.model.dtype} (sums may run in another order)"
