"""Check 8: the reference run's export, reloaded by transformers (and PEFT), gives glmtune's logits.

The reference run exported as `glmtune train` does at its end: full fine-tuning writes
RUN_DIR/hf (`save_pretrained`, in the dtype the run computed in), LoRA writes RUN_DIR/adapter
(PEFT) and RUN_DIR/adapter_per_expert (vLLM / SGLang), on RUN_DIR/base for a preset. Two
comparisons, each of which can fail on its own:

1. Tensor by tensor, the export holds what the last checkpoint holds (`trained.py`): every HF
   tensor of the trained model cast to the dtype written, or every adapter tensor of both
   layouts (`glmtune.peft.adapter_state`), bit for bit, no tensor missing or extra.
2. Logits: transformers' `AutoModelForCausalLM.from_pretrained` on the export (LoRA: on the
   base the adapter names, with `peft.PeftModel.from_pretrained` on the adapter) against
   glmtune's model (full fine-tuning: glmtune reading the same export, whose tensors step 1
   tied to the checkpoint; LoRA: the checkpoint's model) on the first training row's tokens,
   for GLM-5 at most `index_topk` of them, so that the DSA top-k keeps every key and no tie can
   be broken differently (a family without sparse attention: the whole row). In float32 the largest logit difference must be at most 1e-4 (the
   parity tests' bound). In bfloat16 two implementations round differently (glmtune's Triton
   attention, indexer and fused ops against transformers' eager ones), so their difference
   alone cannot tell rounding from a fault. Both models are also run in float32 on the same
   weights (the exported bf16 values, upcast exactly): glmtune's model upcast in place,
   transformers' loaded again in float32 from the export (upcast in place, transformers 5.17's
   model was 1.4e-2 from its own float32 load on a CUDA GPU, while glmtune's agreed with both
   loads to 5e-7: docs/preflight.md). (a) glmtune's float32 logits must
   equal transformers' within `FP32_REL_BOUND` (relative), which catches a real difference
   in the math or the weights; (b) glmtune's bf16 error against that float32 reference must be
   at most `BF16_ERROR_RATIO` times transformers' own bf16 error (or `BF16_REL_FLOOR`), and its
   top-1 agreement with the reference at most `BF16_TOP1_SLACK` below transformers'.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from glmtune.checkpoint.hf_io import checkpoint_files, hf_tensors, written_dtypes
from glmtune.io.json_file import json_name, read_json_file
from glmtune.io.text_limits import clipped
from glmtune.peft.adapter_export import CONFIG_NAME, RUN_DIRS, WEIGHTS_NAME, adapter_state
from glmtune.preflight.context import Preflight
from glmtune.preflight.result import CheckResult, verdict
from glmtune.preflight.runs import ReferenceRun
from glmtune.preflight.trained import trained_model
from glmtune.train.precision import resolve_precision

FP32_BOUND = 1e-4
# bf16 runs (GPU): glmtune and transformers compared in float32 on the same weights, relative error
# (GPU matmuls sum in other orders than the CPU's: not the CPU parity bound), and glmtune's bf16
# rounding against transformers' own, both measured against that float32 reference.
FP32_REL_BOUND = 1e-4
BF16_ERROR_RATIO, BF16_REL_FLOOR, BF16_TOP1_SLACK = 2.0, 1e-2, 0.02


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' load reports (a view's unused layers are "unexpected keys"), progress bars and
    warnings, silenced."""
    from transformers.utils import logging

    previous, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(previous)
        if bars:
            logging.enable_progress_bar()


def _opened(file: Path):
    """A safetensors handle on `file`; ValueError naming it when it is not one (cut short, damaged)."""
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error type (and OSError) for a bad file
        raise ValueError(f"{file}: unreadable safetensors file ({clipped(exc)})") from None


def _tensor(handle, file: Path, key: str) -> torch.Tensor:
    try:
        return handle.get_tensor(key)
    except Exception as exc:  # a header that lies about the data: safetensors' own error type
        raise ValueError(f"{file}: cannot read tensor {key} ({clipped(exc)})") from None


def tensor_problems(expected: dict[str, torch.Tensor], files: dict[str, Path], what: str,
                    dtypes: dict[str, torch.dtype] | None = None) -> list[str]:
    """Every tensor of `expected` (HF key -> tensor) stored in `files` (key -> file) with the same bits,
    in `dtypes[key]` when given (each cast as it is compared: no copy of the model is held)."""
    problems = [f"{what}{key} is missing" for key in expected if key not in files]
    problems += [f"{what}{key} is not part of the trained model" for key in files if key not in expected]
    handles = {}
    for key, want in expected.items():
        if key not in files:
            continue
        file = files[key]
        if file not in handles:
            handles[file] = _opened(file)
        got = _tensor(handles[file], file, key)
        if dtypes is not None and got.dtype != dtypes[key]:
            problems.append(f"{what}{file.name}: {key} is stored as {got.dtype}, the run computes it in {dtypes[key]}")
        want = want.detach().to("cpu", got.dtype)
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "shape"
            problems.append(f"{what}{file.name}: {key} differs from the checkpoint's (max difference {diff})")
    return problems


def compare(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """Largest |difference|, relative error (Frobenius) and top-1 agreement of two [1, S, V] logits."""
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs()
    return {"max_abs_difference": diff.max().item(),
            "relative_error": (diff.norm() / expected.norm().clamp_min(1e-30)).item(),
            "top1_agreement": (actual.argmax(-1) == expected.argmax(-1)).float().mean().item(),
            "positions": expected.shape[1]}


def logit_problems(actual: torch.Tensor, expected: torch.Tensor) -> tuple[list[str], dict[str, Any]]:
    """float32: transformers' logits (`actual`) against glmtune's (`expected`), within FP32_BOUND."""
    stats = {**compare(actual, expected), "bound": f"max |difference| <= {FP32_BOUND}"}
    problems = [] if stats["max_abs_difference"] <= FP32_BOUND else [
        f"logits differ by up to {stats['max_abs_difference']:.3g} (> {FP32_BOUND}, float32)"]
    return problems, stats


def bf16_logit_problems(ours: dict[str, torch.Tensor], served: dict[str, torch.Tensor]
                        ) -> tuple[list[str], dict[str, Any]]:
    """bf16: `ours` and `served` hold "bf16" and "fp32" logits of glmtune and transformers (see the
    module docstring for the two criteria)."""
    reference = served["fp32"]
    fp32 = compare(ours["fp32"], reference)
    ours_bf16, theirs_bf16 = compare(ours["bf16"], reference), compare(served["bf16"], reference)
    allowed = max(BF16_ERROR_RATIO * theirs_bf16["relative_error"], BF16_REL_FLOOR)
    problems = []
    if fp32["relative_error"] > FP32_REL_BOUND:
        problems.append(f"float32 logits differ from transformers': relative error {fp32['relative_error']:.3g} "
                        f"(> {FP32_REL_BOUND}), max |difference| {fp32['max_abs_difference']:.3g}")
    if ours_bf16["relative_error"] > allowed:
        problems.append(f"bfloat16 logits are further from the float32 reference than transformers' own bfloat16: "
                        f"relative error {ours_bf16['relative_error']:.3g} against {theirs_bf16['relative_error']:.3g} "
                        f"(allowed {allowed:.3g})")
    if ours_bf16["top1_agreement"] < theirs_bf16["top1_agreement"] - BF16_TOP1_SLACK:
        problems.append(f"bfloat16 top-1 agreement with the float32 reference {ours_bf16['top1_agreement']:.1%} "
                        f"against transformers' {theirs_bf16['top1_agreement']:.1%}")
    stats = {"glmtune_vs_transformers_fp32": fp32, "glmtune_bf16_vs_fp32": ours_bf16,
             "transformers_bf16_vs_fp32": theirs_bf16,
             "glmtune_vs_transformers_bf16": compare(ours["bf16"], served["bf16"]),
             "bound": f"float32 relative error <= {FP32_REL_BOUND}; bf16 relative error against float32 <= "
                      f"max({BF16_ERROR_RATIO} x transformers' ({allowed:.3g}), {BF16_REL_FLOOR}), top-1 within "
                      f"{BF16_TOP1_SLACK:.0%} of transformers'",
             # the message's figures: glmtune's bf16 against the float32 reference
             "max_abs_difference": ours_bf16["max_abs_difference"], "top1_agreement": ours_bf16["top1_agreement"],
             "relative_error": ours_bf16["relative_error"], "positions": ours_bf16["positions"]}
    return problems, stats


def _both_precisions(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """glmtune's logits as loaded (bf16), then upcast in place to float32 (the same weights)."""
    logits = {"bf16": model(ids).logits.float()}
    model.float()
    logits["fp32"] = model(ids).logits.float()
    return logits


def _loaded_in_both(load: Callable[[torch.dtype], torch.nn.Module], dtype: torch.dtype,
                    ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' logits loaded in `dtype` (bf16), then loaded again in float32 from the same
    export: one model at a time (the module docstring says why not upcast in place)."""
    logits = {}
    for name, precision in (("bf16", dtype), ("fp32", torch.float32)):
        model = load(precision)
        logits[name] = model(ids).logits.float()
        del model
    return logits


def probe_tokens(pf: Preflight, top_k: int | None) -> torch.Tensor:
    """[1, S] tokens of the first training row, S <= the DSA top-k (None: the whole row)."""
    row = pf.data().train_rows[0]
    return torch.tensor([row["input_ids"][:top_k]])


def sparse_top_k(pf: Preflight, model: torch.nn.Module) -> int | None:
    """The keys a query's sparse attention selects, where the family's summary names an indexer (GLM-5's
    DSA: beyond them the selection could break a tie otherwise than transformers); None without one."""
    indexer = pf.spec.architecture.summary(pf.spec.architecture.args_of(model)).get("indexer")
    return indexer["topk"] if isinstance(indexer, dict) else None


def _adapter_models(pf: Preflight, ref: ReferenceRun, dtype: torch.dtype, evidence: dict[str, Any]):
    """LoRA: both adapter layouts against the checkpoint; PEFT on the base the adapter names."""
    import peft
    from transformers import AutoModelForCausalLM

    ours, checkpoint = trained_model(pf, ref.run_dir)
    problems, count = [], 0
    for layout, sub in RUN_DIRS.items():
        _, tensors = adapter_state(ours, layout)
        weights = ref.run_dir / sub / WEIGHTS_NAME
        files = dict.fromkeys(_opened(weights).keys(), weights)
        problems += tensor_problems(tensors, files, f"{sub}/")
        count += len(tensors)
    adapter_dir = ref.run_dir / RUN_DIRS["peft"]
    base = read_json_file(adapter_dir / CONFIG_NAME, max_bytes=1 << 20).get("base_model_name_or_path")
    if not isinstance(base, str):
        raise ValueError(f"{adapter_dir / CONFIG_NAME}: base_model_name_or_path is {json_name(base)}, not the base's "
                         "path")
    def load(precision: torch.dtype) -> torch.nn.Module:
        with _quiet_transformers():
            hf = AutoModelForCausalLM.from_pretrained(base, dtype=precision, attn_implementation="eager")
            return peft.PeftModel.from_pretrained(hf, adapter_dir).to(pf.device).eval()

    evidence.update(checkpoint=str(checkpoint.path), export=[str(ref.run_dir / sub) for sub in RUN_DIRS.values()],
                    base=base, tensors=count, reloaded_by=f"transformers {AutoModelForCausalLM.__name__} on {base} + "
                                                         f"PEFT {peft.__version__} on {adapter_dir}")
    return problems, load, ours


def _hf_models(pf: Preflight, ref: ReferenceRun, dtype: torch.dtype, evidence: dict[str, Any]):
    """Full fine-tuning: RUN_DIR/hf against the checkpoint; transformers and glmtune reading RUN_DIR/hf."""
    from transformers import AutoModelForCausalLM

    export = ref.run_dir / "hf"
    trained, checkpoint = trained_model(pf, ref.run_dir)
    spec = pf.spec
    args = spec.architecture.args_of(trained)
    expected = dict(hf_tensors(trained.state_dict(), spec.weights.state_dict_adapter(args)))
    problems = tensor_problems(expected, checkpoint_files(export), "hf/", written_dtypes(spec.hf_format, args, dtype))
    evidence.update(checkpoint=str(checkpoint.path), export=str(export), tensors=len(expected))
    del trained, expected  # the checkpoint's copy is no longer needed: two models are enough at once

    def load(precision: torch.dtype) -> torch.nn.Module:
        with _quiet_transformers():
            served = AutoModelForCausalLM.from_pretrained(export, dtype=precision, attn_implementation="eager")
        return served.to(pf.device).eval()

    m = pf.scratch().model
    ours = spec.weights.load_pretrained(export, dtype, pf.device, model_cfg=m).eval()
    evidence["reloaded_by"] = f"transformers {AutoModelForCausalLM.__name__} and glmtune on {export}"
    return problems, load, ours


@torch.no_grad()
def check_export(pf: Preflight, ref: ReferenceRun) -> CheckResult:
    dtype = resolve_precision(pf.scratch()).compute_dtype
    dtype_name = str(dtype).removeprefix("torch.")
    evidence: dict[str, Any] = {"dtype": dtype_name}
    problems, load_served, ours = (_adapter_models if pf.lora else _hf_models)(pf, ref, dtype, evidence)
    top_k = sparse_top_k(pf, ours)
    ids = probe_tokens(pf, top_k).to(pf.device)
    evidence["probe"] = f"the first {ids.shape[1]} tokens of the first training row" + (
        " (<= index_topk)" if top_k is not None else "")
    if dtype == torch.float32:
        logit_issues, logits = logit_problems(load_served(dtype)(ids).logits, ours(ids).logits)
    else:  # one model in float32 at a time: the served ones are freed before glmtune's is upcast
        served_logits = _loaded_in_both(load_served, dtype, ids)
        logit_issues, logits = bf16_logit_problems(_both_precisions(ours, ids), served_logits)
    evidence["logits"] = logits
    message = (f"{evidence['tensors']} exported tensors equal the checkpoint's; {evidence['reloaded_by']}: logits "
               f"over {ids.shape[1]} tokens within {logits['bound']} (max difference "
               f"{logits['max_abs_difference']:.3g}, top-1 {logits['top1_agreement']:.0%})")
    return verdict(8, problems + logit_issues, message, evidence)
