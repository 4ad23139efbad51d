"""What `--base` and `--candidate` name, how each is fingerprinted, and how it is loaded.

A model argument is one of
  * an HF directory (config.json + safetensors): "hf";
  * a run directory (config.yaml): "run". As `--candidate` it is the run's result: `hf/` for full
    fine-tuning, `adapter/` on the adapter's base for LoRA. As `--base` it is the model the run
    started from: `base/` (the preset's initial weights every run on a preset writes), else the
    HF directory its `model.name_or_path` names;
  * a PEFT adapter directory (adapter_config.json + adapter_model.safetensors): "adapter", on
    the base its glmtune_adapter.json records (else adapter_config.json's
    base_model_name_or_path; else the run's base/ beside it).
An adapter's recorded base identity is checked against the directory found (content hashes),
and so is a run's base/ against run.json. With `--merged` an adapter candidate is evaluated
twice: unmerged ("candidate": LoRA modules holding the adapter, `adapters.py`) and merged
("candidate-merged": the deltas folded into the base weights, `glmtune.peft.merge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from glmtune.checkpoint.fingerprint import identity_mismatch
from glmtune.config import ModelConfig, load_run_config
from glmtune.data.sources import file_sha256
from glmtune.peft.adapter_load import apply_adapter
from glmtune.io.json_file import json_name, read_json_file
from glmtune.io.run_lock import RUN_FILE, read_run_record
from glmtune.io.text_limits import clipped
from glmtune.models.catalog import AUTO
from glmtune.models.registry import hf_dir_identity, is_preset, spec_for
from glmtune.peft.adapter_export import CONFIG_NAME, META_NAME, WEIGHTS_NAME
from glmtune.peft.merge import config_dtype, merge_adapter_dir

_MAX_RECORD_BYTES = 1 << 20  # adapter_config.json and glmtune_adapter.json are a few hundred bytes
_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "vocab.json", "merges.txt", "tokenizer.model")


@dataclass
class ModelSource:
    label: str  # "base" | "candidate" | "candidate-merged"
    role: str  # "base" | "candidate"
    source: Path  # the argument, absolute
    kind: str  # "hf" | "run" | "adapter"
    weights_dir: Path  # the HF directory loaded (an adapter's base)
    adapter_dir: Path | None = None
    merged: bool | None = None  # None: not an adapter
    recorded_base: dict | None = None  # the base identity an adapter or run records
    run_tokenizer: Path | None = None  # a run's base: the tokenizer the run trained with (its data.tokenizer)
    family: str = AUTO  # the model family that loads it: a run's model.family, else config.json's model_type's

    @property
    def spec(self):
        """The `ModelSpec` of the family that loads (and scores) the weights."""
        return spec_for(self.weights_dir, self.family)

    @property
    def tokenizer_dir(self) -> Path:
        for directory in (self.run_tokenizer, self.adapter_dir, self.weights_dir):
            if directory is not None and any((directory / n).is_file() for n in _TOKENIZER_NAMES):
                return directory
        raise ValueError(f"{self.source}: no tokenizer files in {self.weights_dir} (expected tokenizer.json); "
                         "an evaluation needs the model's own tokenizer and chat template")

    def reads(self) -> list[tuple[str, Path]]:
        """(label, path) of every input this model's evaluation reads (output-safety checks). Of a
        run directory only what is read: the default output, RUN_DIR/eval/<suite>, sits beside them."""
        paths = [(f"{self.label} weights", self.weights_dir)]
        paths += [(f"{self.label} adapter", self.adapter_dir)] if self.adapter_dir else []
        paths += [(f"{self.label} tokenizer", self.run_tokenizer)] if self.run_tokenizer else []
        if self.kind == "run":
            paths += [(f"{self.label} run data", self.source / "data")]
        else:
            paths += [(f"--{self.role}", self.source)]
        return paths


def _recorded_base(value: object, where: Path) -> dict | None:
    """The base identity a glmtune_adapter.json or run.json records (None when it records none), its
    path and hashes strings; ValueError naming the file for anything else."""
    if value is None:
        return None
    if not (isinstance(value, dict) and all(isinstance(value.get(key, ""), str)
                                            for key in ("path", "config_sha256", "weights_sha256"))):
        raise ValueError(f"{where}: its base is {json_name(value)} that is not a glmtune base identity (a path and "
                         "sha256 strings); not a file glmtune writes")
    return value


def _adapter_base(adapter_dir: Path) -> tuple[Path, dict | None]:
    """The base directory of an exported adapter and the identity it records (None if none)."""
    config = read_json_file(adapter_dir / CONFIG_NAME, max_bytes=_MAX_RECORD_BYTES)
    named_in_config = config.get("base_model_name_or_path")
    if named_in_config is not None and not isinstance(named_in_config, str):
        raise ValueError(f"{adapter_dir / CONFIG_NAME}: base_model_name_or_path is {json_name(named_in_config)}, "
                         "not a path")
    meta_path = adapter_dir / META_NAME
    meta = read_json_file(meta_path, max_bytes=_MAX_RECORD_BYTES) if meta_path.is_file() else {}
    recorded = _recorded_base(meta.get("base"), meta_path)
    named = [p for p in ((recorded or {}).get("path"), named_in_config) if p]
    # A run directory moved since training: its base/ moved with it (taken only when the adapter records
    # the identity `Fingerprints.of` then checks it against).
    beside = [adapter_dir.parent / "base"] if recorded else []
    for candidate in [Path(p) for p in named] + beside:
        if (candidate / "config.json").is_file():
            return candidate.resolve(), recorded
    raise ValueError(f"{adapter_dir}: its base {clipped(named[0]) if named else '(not recorded)'} is not a local HF "
                     "directory; an adapter is evaluated on the base it was trained on")


def resolve_model(arg: str | Path, role: str) -> ModelSource:
    """What `--base` / `--candidate` ARG names (module docstring); ValueError when it is none of them."""
    option = f"--{role}"
    path = Path(arg).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{option} {arg}: not a directory (an HF checkpoint, a run directory or an adapter)")
    if (path / CONFIG_NAME).is_file():
        if role == "base":
            raise ValueError(f"{option} {arg} is a LoRA adapter; the base is a full model (its HF directory or "
                             "the run directory it was trained in)")
        base, recorded = _adapter_base(path)
        return ModelSource(role, role, path, "adapter", base, path, False, recorded)
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        return _from_run(path, role, option)
    if (path / "config.json").is_file():
        return ModelSource(role, role, path, "hf", path)
    raise ValueError(f"{option} {arg}: neither an HF checkpoint (config.json), a run directory (config.yaml) "
                     f"nor an adapter ({CONFIG_NAME})")


def _from_run(run_dir: Path, role: str, option: str) -> ModelSource:
    """The run's base or result (module docstring), loaded by the family the run's model.family chose."""
    source = _run_model(run_dir, role, option)
    source.family = load_run_config(run_dir / "config.yaml").model.family
    return source


def _run_model(run_dir: Path, role: str, option: str) -> ModelSource:
    cfg = load_run_config(run_dir / "config.yaml")
    record = read_run_record(run_dir) or {}
    recorded_base = _recorded_base(record.get("base"), run_dir / RUN_FILE)
    if role == "base":
        if (run_dir / "base" / "config.json").is_file():
            return ModelSource(role, role, run_dir, "run", run_dir / "base", recorded_base=recorded_base)
        if not is_preset(cfg.model.name_or_path) and (Path(cfg.model.name_or_path) / "config.json").is_file():
            # prompted with the tokenizer the run trained with (data.tokenizer), as its candidate's hf/ is
            tokenizer = Path(cfg.data.tokenizer).resolve() if cfg.data.tokenizer else None
            return ModelSource(role, role, run_dir, "run", Path(cfg.model.name_or_path).resolve(),
                               recorded_base=recorded_base, run_tokenizer=tokenizer)
        raise ValueError(f"{option} {run_dir}: the run records no base model to evaluate (no base/ and "
                         f"model.name_or_path {cfg.model.name_or_path!r} is not an HF directory); pass the base's "
                         "HF directory")
    if cfg.peft.method == "lora":
        adapter = run_dir / "adapter"
        if not (adapter / CONFIG_NAME).is_file():
            raise ValueError(f"{option} {run_dir}: the LoRA run has no adapter/ (it has not finished); export one "
                             "with `glmtune export RUN_DIR --adapter OUT` and pass OUT")
        base, recorded = _adapter_base(adapter)
        return ModelSource(role, role, run_dir, "run", base, adapter, False, recorded)
    if not (run_dir / "hf" / "config.json").is_file():
        raise ValueError(f"{option} {run_dir}: the run has no hf/ export (it has not finished, or ran with "
                         "checkpoint.export_hf: false)")
    return ModelSource(role, role, run_dir, "run", run_dir / "hf")


def merged_variant(candidate: ModelSource) -> ModelSource:
    """The same adapter candidate, merged ("candidate-merged")."""
    if candidate.adapter_dir is None:
        raise ValueError(f"--merged: the candidate {candidate.source} is not a LoRA adapter (nothing to merge)")
    return ModelSource("candidate-merged", "candidate", candidate.source, candidate.kind, candidate.weights_dir,
                       candidate.adapter_dir, True, candidate.recorded_base, candidate.run_tokenizer, candidate.family)


class Fingerprints:
    """Content hashes of the evaluated models, each directory hashed once."""

    def __init__(self) -> None:
        self._identities: dict[Path, dict] = {}

    def identity(self, hf_dir: Path) -> dict:
        if hf_dir not in self._identities:
            self._identities[hf_dir] = hf_dir_identity(hf_dir)
        return self._identities[hf_dir]

    def of(self, model: ModelSource) -> dict:
        """{"config_sha256", "weights_sha256", "path"} (+ "base" for adapters); checks recorded bases."""
        weights = self.identity(model.weights_dir)
        if model.recorded_base:
            reasons = identity_mismatch(model.recorded_base, weights)
            if reasons:
                what = "adapter was trained on" if model.adapter_dir else "run started from"
                raise ValueError(f"{model.weights_dir} is not the base the {what} ({'; '.join(reasons)}); restore "
                                 "that base")
        base = {"config_sha256": weights["config_sha256"], "weights_sha256": weights["weights_sha256"],
                "path": str(model.weights_dir)}
        if model.adapter_dir is None:
            return base
        return {"config_sha256": file_sha256(model.adapter_dir / CONFIG_NAME),
                "weights_sha256": file_sha256(model.adapter_dir / WEIGHTS_NAME),
                "path": str(model.adapter_dir), "base": base}


def checkpoint_dtype(hf_dir: Path) -> torch.dtype:
    return config_dtype(hf_dir)


def load_model(model: ModelSource, device: torch.device, dtype: torch.dtype | None, fp8_base: str = "none"):
    """The model in eval mode on `device` (dtype None: the checkpoint's own), loaded by its family's
    spec; `fp8_base` "dequant": its weights kept in FP8 as a LoRA run keeps its frozen base."""
    dtype = dtype or checkpoint_dtype(model.weights_dir)
    spec = model.spec
    if fp8_base == "none":
        net = spec.weights.load_pretrained(model.weights_dir, dtype, device)
    else:
        net, _ = spec.weights.build_from_config(ModelConfig(name_or_path=str(model.weights_dir), fp8_base=fp8_base,
                                                    family=model.family), dtype, device)
    if model.adapter_dir is not None:
        if model.merged:
            merge_adapter_dir(net, model.adapter_dir)
        else:
            apply_adapter(net, model.adapter_dir)
    return net.eval()
