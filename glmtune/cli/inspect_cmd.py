"""`glmtune inspect PATH_OR_PRESET [--json] [--verify]`: what a model (GLM-5, or any hf-family one) is made of.

Without loading weights (a GLM-5 model is built on the meta device, an hf one counted from its
config.json's shapes) it prints the
architecture (the family's own rows), the layer table (dense/MoE MLP, GLM-5's full/shared
indexer, runs of identical layers merged), total and active parameter counts, and parameters
per group. `--json` prints the same content as one JSON object. `--verify` checks a
checkpoint directory's shards, keys, shapes and dtypes from the safetensors headers
and exits 1 when anything is wrong, listing every problem. `--trainable RECIPE.yaml`
builds the recipe's model on the meta device, applies its freezing / LoRA config and
adds what trains: a trainable column per group and the trainable-parameter inventory
(the same table every training run logs at start).

The numbers and the build come from the model's family through its spec
(`glmtune.models.registry`: summary, architecture rows, parameter report, layer runs; an hf
directory's from its config.json's shapes), imported when the command
runs: `glmtune --help` stays torch-free (the presets come from the torch-free catalog).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from glmtune.models.catalog import PRESETS

if TYPE_CHECKING:
    from glmtune.checkpoint.hf_verify import VerifyReport
    from glmtune.models.common.model_spec import ModelSpec

_EXAMPLES = """examples:
  glmtune inspect glm5
  glmtune inspect glm5.2 --json
  glmtune inspect /ckpt/GLM-5 --verify
  glmtune inspect --trainable recipes/tiny/lora_support_json.yaml
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="architecture, layer table and parameter counts; --verify a checkpoint",
        description="Summarise a model from a preset or an HF checkpoint directory (GLM-5, or any causal LM "
        "transformers implements) without loading weights. "
        f"Presets: {', '.join(PRESETS)}.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="PATH_OR_PRESET", nargs="?", default=None,
                        help="preset name or HF checkpoint directory (omit with --trainable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--verify", action="store_true",
                        help="check the directory's shards, keys, shapes and dtypes (headers only); exit 1 on problems")
    parser.add_argument("--trainable", metavar="RECIPE.yaml", default=None,
                        help="show what the recipe trains (its model, freezing and LoRA targets), by group")
    parser.set_defaults(func=run)


def trainable_inventory(recipe: str) -> tuple[ModelSpec, Any, Any]:
    """(model spec, model args, inventory) of a recipe's model after its freezing / LoRA transform, on meta."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.config import load_config
    from glmtune.models.registry import model_args, model_spec
    from glmtune.peft import apply_lora, build_inventory

    cfg = load_config(recipe)
    spec, args = model_spec(cfg.model), model_args(cfg.model)
    model = spec.weights.build(args, device="meta")
    # as training does: the MTP layer and the indexers train with their losses (LoRA adapts the MTP layer then)
    spec.compute.set_auxiliary_training(model, mtp=cfg.train.mtp_loss_weight > 0, indexer=cfg.model.indexer_trainable)
    inventory = apply_lora(model, cfg.peft) if cfg.peft.method == "lora" else build_inventory(model)
    return spec, args, inventory


def inspect_payload(source: str, spec: ModelSpec, args: Any,
                    trainable_by_group: dict[str, int] | None = None) -> dict[str, Any]:
    """Everything `inspect` shows, as one JSON-serialisable dict."""
    arch = spec.architecture
    payload = {"source": source, "architecture": arch.summary(args), **arch.parameter_report(args)}
    if trainable_by_group is not None:
        payload["trainable_params_by_group"] = trainable_by_group
    return payload


def verify_dir(path: str) -> VerifyReport:
    """`--verify`: the checkpoint directory checked by the family its config.json names (through the
    spec's `hf_format`); a config.json that cannot be read is the default family's reader's problem
    to report, beside what the shards' headers say."""
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.checkpoint.hf_verify import verify_checkpoint
    from glmtune.models.registry import SPECS, spec_for

    if not Path(path).is_dir():
        raise ValueError(f"--verify needs a checkpoint directory; {path!r} is not one")
    try:
        spec = spec_for(path)
    except ValueError:  # config.json unreadable: reported by the verification itself
        spec = next(iter(SPECS.values()))
    if spec.hf_format is None:
        raise ValueError(f"--verify: glmtune cannot verify a checkpoint of the {spec.family.name} family yet")
    return verify_checkpoint(path, spec.hf_format)


def run(ns: argparse.Namespace) -> int:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.models.registry import resolve_args, spec_for

    if ns.trainable is not None:
        return _run_trainable(ns)
    if ns.model is None:
        raise ValueError("give a PATH_OR_PRESET to inspect, or --trainable RECIPE.yaml")
    report: VerifyReport | None = None
    if ns.verify:
        report = verify_dir(ns.model)
        args = report.args
    else:
        args = resolve_args(ns.model)
    # A config that does not load is itself a verify problem: report it, no summary.
    spec = spec_for(ns.model) if args is not None else None
    payload = _payload(str(ns.model), spec, args, verifying=report is not None)
    if report is not None:
        payload["verify"] = report.to_dict()
    if ns.json:
        print(json.dumps(payload, indent=2, ensure_ascii=False))
    else:
        console = Console(highlight=False)
        if "undescribed" in payload:
            console.print(f"[bold]{escape(payload['source'])}[/bold]: {escape(payload['undescribed'])}")
        elif spec is not None:
            _print_summary(console, spec, payload)
        if report is not None:
            _print_verify(console, report)
    return 1 if report is not None and not report.ok else 0


def _payload(source: str, spec: ModelSpec | None, args: Any, verifying: bool) -> dict[str, Any]:
    """`inspect_payload` (the source alone without a spec); with --verify, for a family that does not
    describe its models yet, the source and why not (`undescribed`): the verification stands alone."""
    if spec is None:
        return {"source": source}
    try:
        return inspect_payload(source, spec, args)
    except ValueError as exc:  # the family's own sentence ("the hf family does not do ... yet")
        if not verifying:
            raise
        return {"source": source, "undescribed": str(exc)}


def _run_trainable(ns: argparse.Namespace) -> int:
    if ns.model is not None or ns.verify:
        raise ValueError("--trainable RECIPE.yaml takes the model from the recipe; "
                         "give no PATH_OR_PRESET and no --verify with it")
    spec, args, inventory = trainable_inventory(ns.trainable)
    payload = inspect_payload(f"{ns.trainable}", spec, args, trainable_by_group=inventory.trainable_by_group())
    payload["trainable_inventory"] = inventory.to_dict()
    if ns.json:
        print(json.dumps(payload, indent=2, ensure_ascii=False))
        return 0
    console = Console(highlight=False)
    _print_summary(console, spec, payload)
    console.print(inventory.table())
    return 0


# -- rich rendering --------------------------------------------------------------------
def billions(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def human(n: int | float) -> str:
    """2 decimals in the largest unit that keeps the number >= 1 (B, M, K)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _span(low: int, high: int) -> str:
    """"9.87–9.88B" (one unit when both ends share it), "400.90M–1.20B" otherwise."""
    low_text, high_text = human(low), human(high)
    if low == high:
        return low_text
    if low_text[-1] == high_text[-1]:
        return f"{low_text[:-1]}–{high_text}"
    return f"{low_text}–{high_text}"


def _mlp_text(row: dict[str, Any]) -> str:
    return ("MoE" if row["mlp"] == "moe" else "dense") + (" (MTP)" if row.get("mtp") else "")


def format_indices(indices: list[int]) -> str:
    """[0, 1, 2, 6, 10, 14, 18] -> "0–2, 6, 10, …, 18": ranges and arithmetic runs folded."""
    parts, i = [], 0
    while i < len(indices):
        j, step = i, None
        if i + 1 < len(indices):
            step, j = indices[i + 1] - indices[i], i + 1
            while j + 1 < len(indices) and indices[j + 1] - indices[j] == step:
                j += 1
        count = j - i + 1
        if count >= 3 and step == 1:
            parts.append(f"{indices[i]}–{indices[j]}")
        elif count >= 4:
            parts.append(f"{indices[i]}, {indices[i + 1]}, …, {indices[j]}")
        else:
            parts.append(str(indices[i]))
            j = i
        i = j + 1
    return ", ".join(parts)


def _display_rows(spec: ModelSpec, layers: list[dict[str, Any]], indexer: bool) -> list[tuple[str, ...]]:
    """Layer-table rows: runs of identical layers; a block of one MLP kind whose indexer
    alternates (GLM-5.2's full/shared pattern) is folded into one row. `indexer`: the layers
    have one (an indexer column)."""
    blocks: list[list[dict[str, Any]]] = []
    for row in layers:
        if blocks and (blocks[-1][-1]["mlp"], blocks[-1][-1].get("mtp")) == (row["mlp"], row.get("mtp")):
            blocks[-1].append(row)
        else:
            blocks.append([row])
    rows = []
    for block in blocks:
        runs = spec.architecture.layer_runs(block)
        if len(runs) <= 2:
            for run in runs:
                span = str(run["first"]) if run["count"] == 1 else f"{run['first']}–{run['last']}"
                rows.append((span, str(run["count"]), _mlp_text(run), *((run["indexer"],) if indexer else ()),
                             human(run["params_per_layer"]), human(run["active_params_per_layer"])))
            continue
        assert indexer, "only an alternating indexer makes more than two runs of one MLP kind"
        first, last = block[0], block[-1]
        num_full = sum(row["indexer"] == "full" for row in block)
        params = sorted({row["params"] for row in block})
        active = sorted({row["active_params"] for row in block})
        rows.append((f"{first['index']}–{last['index']}", str(len(block)), _mlp_text(first),
                     f"{num_full} full, {len(block) - num_full} shared",
                     _span(params[0], params[-1]), _span(active[0], active[-1])))
    return rows


def _print_summary(console: Console, spec: ModelSpec, payload: dict[str, Any]) -> None:
    arch = payload["architecture"]
    console.print(f"[bold]{escape(payload['source'])}[/bold]: {arch['architecture']} ({arch['model_type']})")

    table = Table(title="Architecture", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, text in spec.architecture.architecture_rows(arch):  # the family's own (its spec)
        table.add_row(label, text)
    console.print(table)
    _print_layers(console, spec, payload)
    _print_counts(console, payload)
    if payload.get("layout_known") is False:
        console.print(f"{arch['model_type']}: a layer glmtune does not know, counted as Llama's; the counts may miss "
                      "a few norm or bias vectors per layer")


def _print_layers(console: Console, spec: ModelSpec, payload: dict[str, Any]) -> None:
    arch, layers = payload["architecture"], payload["layers"]
    indexer = all("indexer" in row for row in layers)
    table = Table(title="Layers", title_justify="left")
    for name, justify in (("layers", "left"), ("n", "right"), ("mlp", "left"), ("indexer", "left"),
                          ("params/layer", "right"), ("active/layer", "right")):
        if name != "indexer" or indexer:
            table.add_column(name, justify=justify)
    for row in _display_rows(spec, layers, indexer):
        table.add_row(*row)
    full_layers = arch["indexer"]["full_layers"] if indexer else None
    if full_layers is not None and len(full_layers) < arch["num_hidden_layers"]:
        table.caption = f"full indexer on layers {format_indices(full_layers)} (MTP layers: full)"
    console.print(table)


def _print_counts(console: Console, payload: dict[str, Any]) -> None:
    """The totals and the groups; a family with MTP layers counts the model without and with them."""
    mtp = "total_params_with_mtp" in payload
    table = Table(title="Parameters", title_justify="left")
    table.add_column("")
    table.add_column("B", justify="right")
    table.add_column("exact", justify="right")
    counts = (
        ("total (no MTP)" if mtp else "total", "total_params"),
        ("total with MTP", "total_params_with_mtp"),
        ("active / token, excl. input embedding", "active_params"),
        ("active / token, incl. embedding", "active_params_incl_embedding"),
        ("active / token, excl. embedding + head", "active_params_excl_embedding_and_head"),
    )
    for label, key in counts:
        if key in payload:
            table.add_row(label, billions(payload[key]), f"{payload[key]:,}")
    buffers = payload.get("buffers")
    if buffers is not None:
        table.add_row("router bias buffers (not params)", "",
                      f"{buffers['e_score_correction_bias']:,} (+{buffers['e_score_correction_bias_mtp']:,} MTP)")
    console.print(table)

    trainable = payload.get("trainable_params_by_group")
    table = Table(title="Parameters by group", title_justify="left")
    table.add_column("group")
    table.add_column("params", justify="right")
    table.add_column("exact", justify="right")
    table.add_column("share", justify="right")
    table.add_column("active", justify="right")
    if trainable is not None:
        table.add_column("trainable", justify="right")
    total = payload["total_params_with_mtp"] if mtp else payload["total_params"]
    for group, n in payload["params_by_group"].items():
        row = [group, human(n), f"{n:,}", f"{100 * n / total:.1f}%", human(payload["active_params_by_group"][group])]
        if trainable is not None:
            row.append(f"{trainable[group]:,}")
        table.add_row(*row)
    console.print(table)


def _print_verify(console: Console, report: VerifyReport) -> None:
    # lazily: `glmtune --help` and `glmtune config validate` stay torch-free
    from glmtune.checkpoint.hf_verify import format_report

    style = "green" if report.ok else "red"
    console.print(f"[bold {style}]verify[/bold {style}]")
    for line in format_report(report):
        # Problems carry shapes like (2048, 6144) and paths: no markup, no re-wrapping.
        console.print(line, markup=False, soft_wrap=True)
