"""`glmtune merge BASE_DIR ADAPTER_DIR OUT_DIR`: fold a LoRA adapter into an HF checkpoint.

BASE_DIR is an HF directory (config.json + safetensors) of a family glmtune trains: GLM-5, or any
causal LM transformers implements (the hf family), its family chosen by config.json's
model_type; ADAPTER_DIR an adapter written by `glmtune export` or
at the end of a LoRA run (either layout).
OUT_DIR receives a full HF checkpoint (transformers and serving engines load it
like the base), with the base's tokenizer files copied alongside; it is written shard by
shard (`glmtune/peft/merge_stream.py`), never holding the model. A non-empty OUT_DIR
is replaced only with --overwrite, and never when it is, is inside or contains
BASE_DIR or ADAPTER_DIR. An adapter that records its base (glmtune_adapter.json) is
merged only onto that base unless --force. OUT_DIR/README.md is the model card of the adapter's
run (its sections from the run's records), when the adapter lies in its run directory or is an
export whose card names the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from glmtune.cli.arg_types import DTYPE_CHOICES
from glmtune.io.sizes import size_arg

def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="merge a LoRA adapter into a base HF checkpoint",
        description="Add the adapter's low-rank deltas (in fp32) to BASE_DIR's weights and write a merged HF "
                    "checkpoint to OUT_DIR, shard by shard: host memory holds about one input shard, one "
                    "output shard and the adapter, whatever the model's size (a progress bar on a terminal).",
    )
    parser.add_argument("base_dir", metavar="BASE_DIR", help="base HF checkpoint directory")
    parser.add_argument("adapter_dir", metavar="ADAPTER_DIR", help="adapter directory (adapter_config.json)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the merged checkpoint")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="merged weight dtype (default: the base checkpoint's)")
    parser.add_argument("--max-shard-size", type=size_arg, default="5GB",
                        help="safetensors shard size: bytes or e.g. 500MB, 5GB (default: 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if it is an earlier glmtune merge or HF export (never anything "
                             "else, never inside a run directory, never BASE_DIR or ADAPTER_DIR)")
    parser.add_argument("--fp8", action="store_true",
                        help="write the merged projections and experts as FP8 (e4m3, 128x128 block scales, as "
                             "GLM-5's FP8 releases) and print the re-quantization error")
    parser.add_argument("--force", action="store_true",
                        help="merge even if BASE_DIR is not the base the adapter was trained on")
    parser.set_defaults(func=_run)


def _run(ns: argparse.Namespace) -> int:
    import torch

    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.peft.merge import merge_to_dir

    dtype = None if ns.dtype == "auto" else getattr(torch, ns.dtype)
    out = merge_to_dir(ns.base_dir, ns.adapter_dir, ns.out_dir, dtype=dtype, max_shard_size=ns.max_shard_size,
                       overwrite=ns.overwrite, force=ns.force, fp8=ns.fp8)
    print(f"merged {ns.adapter_dir} into {ns.base_dir}: {out}")
    _write_card(Path(ns.adapter_dir), Path(out))
    return 0


def _write_card(adapter_dir: Path, out: Path) -> None:
    """OUT_DIR/README.md, the model card of the adapter's run (glmtune/release/model_card.py), when the
    run is known: the adapter lies in its run directory, or its exported card names it."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.release.model_card import write_run_card
    from glmtune.release.model_card_facts import run_dir_of_adapter

    run_dir = run_dir_of_adapter(adapter_dir)
    if run_dir is None:
        print(f"no model card: {adapter_dir} is neither in a run directory nor an export whose card names its run")
        return
    print(f"wrote the model card {write_run_card(run_dir, out, out, 'merged')}")
