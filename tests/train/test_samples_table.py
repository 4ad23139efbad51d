"""The before/after table shows model outputs as text: no rich markup, no terminal escapes."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from glmtune.train.run import _samples_table


def test_model_output_is_text_not_markup_or_escapes():
    before = [SimpleNamespace(prompt="ticket [/x]", reference="ref", output="[/bold] \x1b[2J", exact=False)]
    after = [SimpleNamespace(prompt="ticket [/x]", reference="ref", output='{"a": 1}[/]', exact=True)]
    console = Console(width=160, record=True, color_system=None)
    console.print(_samples_table(before, after))  # rich markup in a cell would raise MarkupError here
    shown = console.export_text()
    assert "ticket [/x]" in shown and "[/bold] \\x1b[2J" in shown and '✓ {"a": 1}[/]' in shown
    assert "\x1b" not in shown
