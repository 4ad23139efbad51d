"""`glmtune plan`'s output: one JSON-ready dict, and the same as rich tables for a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

GIB = 2**30


def _tb(nbytes: float) -> str:
    return f"{nbytes / 1e12:.2f} TB" if nbytes >= 1e11 else f"{nbytes / 1e9:.1f} GB"


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def print_report(report: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]{report['recipe']}[/bold]: {report['model']}")
    if "adapters" in report:  # a LoRA recipe: its adapters on their own line, apart from the model's count
        console.print(report["adapters"])
    floor = Table(title="Model-state floor (whole model, before activations)", title_justify="left")
    floor.add_column("state")
    floor.add_column("bytes", justify="right")
    floor.add_column("how")
    for row in report["floor"]:
        floor.add_row(row["what"], _tb(row["bytes"]), row["note"])
    console.print(floor)

    layout = report["layout"]
    mem = report["memory"]
    table = Table(title=f"Per GPU, the recipe's layout: {layout['describe']} "
                        f"(busiest rank {mem['rank']}, peak in {mem['peak_phase']})", title_justify="left")
    table.add_column("part of the peak")
    table.add_column("GiB", justify="right")
    for part, value in sorted(mem["peak_parts"].items(), key=lambda kv: -kv[1]):
        if value:
            table.add_row(part, _gib(value))
    table.add_row("[bold]planned peak (allocator)[/bold]", f"[bold]{_gib(mem['peak_bytes'])}[/bold]")
    console.print(table)
    console.print(f"objective: {report['objective']}")
    if "memory_model" in report:  # the family's memory model does not know this layer exactly
        console.print(f"[yellow]memory model: {report['memory_model']}[/yellow]")
    console.print(f"micro-batch: {report['micro_batch']}; headroom: {report['headroom']['context_gib']} GiB "
                  f"context + {report['headroom']['fragmentation']:.0%} of the peak")

    fits = Table(title="Fit by GPU", title_justify="left")
    for column in ("GPU", "recipe's layout", "free GiB", "smallest fit", "its layout", "its peak GiB"):
        fits.add_column(column, justify="right" if "GiB" in column else "left")
    for gpu in report["gpus"]:
        own = gpu["recipe_layout"]
        best = gpu["smallest_fit"]
        fits.add_row(gpu["gpu"], "fits" if own["fits"] else "[red]does not fit[/red]", f"{own['free_gib']:.1f}",
                     f"{best['gpus']} GPUs" if best else "none up to the search limit",
                     _describe_layout(best["layout"]) if best else "", f"{best['peak_gib']:.1f}" if best else "")
    console.print(fits)

    _print_data(report.get("data"), console)
    run = report["run"]
    console.print(f"run: {run['steps']:,} steps = {run['tokens']:,} tokens ({run['source']})")
    _print_time(report, console)


def _print_data(data: dict[str, Any] | None, console: Console) -> None:
    """The data lines: the epoch's packed rows, a text corpus' contract counts, a replay mix's sources."""
    if data and "rows" in data:
        console.print(f"data: {data['rows']:,} packed rows of {data['seq']} per epoch = {data['tokens']:,} tokens "
                      f"({data['real_tokens']:,} real, {data['documents_per_row']} documents a row, "
                      f"{data['one_document_rows']:,} one-document rows)")
        corpus = data.get("corpus")
        if corpus:  # a text corpus: its tokens before and after the contract (data/text_contract.py)
            removed = ", ".join(f"{rule} {tokens:,}" for rule, tokens in corpus["removed_tokens"].items()) or "none"
            kept = ", ".join(f"{split} {tokens:,}" for split, tokens in corpus["kept_tokens"].items())
            console.print(f"corpus: {corpus['documents']:,} documents, {corpus['tokens']:,} tokens read; removed by "
                          f"the contract: {removed}; kept: {kept}")
        if data.get("mix"):  # a replay mix: an epoch is one pass over the domain's rows (plan/data_tokens.py)
            mix = data["mix"]
            shares = " / ".join(f"{name} {weight:.2f}" for name, weight in mix["weights"].items())
            rows = ", ".join(f"{name} {count:,}" for name, count in mix["rows"].items())
            console.print(f"mix: {shares} of the target tokens; an epoch is one pass over the domain's rows: {rows} "
                          f"rows (of {mix['replay_rows_available']:,} replay rows)")
    elif data:
        console.print(f"data: {data['note']}")


def _print_time(report: dict[str, Any], console: Console) -> None:
    """The time and cost table, one row per GPU kind with a speed, and each one's assumptions."""
    time_rows = [g for g in report["gpus"] if g.get("time")]
    if time_rows:
        t = Table(title=f"Time and cost ({report['throughput']['source']})", title_justify="left")
        for column in ("GPU", "GPUs", "tok/s/GPU", "compute h", "ckpt h", "restart h", "wall h", "GPU-h", "cost"):
            t.add_column(column, justify="right")
        for gpu in time_rows:
            c = gpu["time"]
            t.add_row(gpu["gpu"], str(c["gpus"]), f"{c['tokens_per_s_per_gpu']:,.0f}", f"{c['compute_hours']:.2f}",
                      f"{c['checkpoint_hours']:.2f}", f"{c['restart_hours']:.2f}", f"{c['wall_hours']:.2f}",
                      f"{c['gpu_hours']:,.0f}", f"{c['cost']:,.0f}" if c["cost"] is not None else "(no price)")
        console.print(t)
        for gpu in time_rows:
            console.print(f"{gpu['gpu']}: {gpu['time_assumption']}")
    else:
        console.print(f"time and cost: {report['throughput']['note']}")


def _describe_layout(layout: dict[str, int]) -> str:
    return " x ".join(f"{k} {v}" for k, v in layout.items() if k != "ep") + f", ep {layout['ep']}"
