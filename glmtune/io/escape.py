"""Untrusted text escaped for the medium it is written into: Markdown, a rich console, HTML.

A model's answer, a data row's prompt or category, a suite's gate name, a model's label or
source: any of them may hold text that the medium would act on rather than show:

  * terminal escapes (ESC/CSI/OSC sequences, C1 controls, CR, backspace) that clear the
    screen or overwrite a line with a forged "ALL GATES PASSED", and bidi overrides that
    reorder what is shown (made visible by `printable`, e.g. `\\x1b`);
  * Markdown: a `|` or a newline that splits a table row, HTML tags (`<script>`,
    `<img onerror>`) that a renderer passes through, emphasis, links, images, code spans
    and `$...$` math that restyle or relabel a verdict;
  * rich console markup (`[bold green]PASSED[/]`).

Each medium has one function here; every untrusted string on its way out goes through it:

  * `md_text(value, limit=None)`: Markdown prose or a table cell (one line; `|` escaped). No
    untrusted string goes into a code span: one could close it, and `cat` would show its raw `<`.
  * `console_text(value)`: a string printed through rich (`Console.print`, a `Table` cell).
  * `visible(value)`: multi-line text for an autoescaped HTML page (controls shown, lines kept).
"""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape as _rich_escape

from glmtune.io.text_limits import printable

# Characters with a meaning in (GitHub-flavoured) Markdown inline text, escaped with a backslash:
# backslash itself, code spans, emphasis, links/images, strikethrough, table cells, math. An `_`
# between two letters or digits cannot open or close emphasis (CommonMark's flanking rules), so
# `snake_case` stays as written.
_MD_PUNCT = re.compile(r"[\\`*\[\]~|$]|(?<![^\W_])_|_(?![^\W_])")
_MD_ENTITIES = {"&": "&amp;", "<": "&lt;"}  # raw HTML and autolinks made inert text (a lone ">" is text)
_NEWLINES = re.compile(r"\r\n|\n")


def _truncated(value: Any, limit: int | None) -> str:
    text = "" if value is None else str(value)
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "…"


def md_text(value: Any, limit: int | None = None) -> str:
    """`value` (via str; None as "") as literal Markdown inline text on one line.

    Truncated to `limit` characters first (so an escape is never cut in half); newlines shown
    as ` ⏎ `, tabs as a space, other control characters as `\\x..` escapes; `&` and `<` as
    entities; Markdown punctuation (and `|`, which would end a table cell) backslash-escaped.
    """
    text = _NEWLINES.sub(" ⏎ ", _truncated(value, limit)).replace("\t", " ")
    text = _MD_PUNCT.sub(lambda match: "\\" + match.group(0), text)
    text = "".join(_MD_ENTITIES.get(ch, ch) for ch in text)
    return printable(text)


def console_text(value: Any) -> str:
    """`value` for rich's `Console.print` or a `Table` cell: controls shown escaped (newlines
    too) and rich markup (`[bold]`) escaped so it prints as written."""
    return _rich_escape(printable(value))


def visible(value: Any) -> str:
    """Multi-line text for HTML (escaped there by the template): newlines and tabs kept (CRLF
    as a newline), every other control character and bidi override shown escaped."""
    return printable(str(value).replace("\r\n", "\n"), multiline=True)
