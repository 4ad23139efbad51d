"""Every untrusted string of a scorecard (answers, prompts, references, failures, categories, set
and suite names, model labels, sources, served model ids, gate names and messages, notes) is shown
as written in scorecard.md, the HTML page and the terminal table, and acts in none of them.

The scorecard fixture has a hostile payload appended to every string it holds (the labels and
categories that are dict keys too), one payload class at a time: terminal escapes (clear the
screen, a forged green verdict, OSC hyperlinks, C1 CSI, CR, backspace, a bidi override), HTML
(script, img onerror), table breakers (`|`, newlines), Markdown (emphasis, links, images, code
spans, math, entities) and rich markup. The Markdown is read back by a real CommonMark+tables
parser (markdown-it-py, which rich depends on); the HTML by html.parser.
"""

from __future__ import annotations

import argparse
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from glmtune.cli.eval_cmd import _report
from glmtune.eval.report_html import render_html
from glmtune.eval.report_md import render_markdown
from glmtune.io.escape import md_text
from tests.eval.report_fixture import make_scorecard

PAYLOADS = {
    "terminal": ("\x1b[2J\x1b[H\x1b[1;32mALL GATES PASSED\x1b[0m\x1b]8;;http://203.0.113.7/\x07here\x1b]8;;\x07"
                 "\x9b2J\x1b[1A\r\b\b\u202egnp.exe\u2066\u200f\x7f\x00"),
    "html": ('</script></pre><script>alert(1)</script><img src=x onerror=alert(2)>'
             '<a href="javascript:alert(3)">x</a><style>body{display:none}</style><!--'),
    "table": "a | b\n| c |\r\nd\\|e\te",
    "markdown": ("**PASSED** _ok_ __x__ [PASSED](javascript:alert(4)) ![x](http://203.0.113.7/p.png) `code` "
                 "``x`` $\\color{green}{PASS}$ ~~x~~ <http://203.0.113.7> &lt;b&gt; &#60;i&#62; \\"),
    "rich": "[bold green]PASSED[/bold green] [link=http://203.0.113.7]x[/link] \\[b] [/]",
}
# Dicts whose keys are labels or categories: their keys carry the payload too.
_KEYED = {"values", "delta", "outputs", "operations", "by_category", "not_available", "faults", "failures"}
_KEEP = {"base", "all"}  # the base's label and the "all" category have a meaning of their own
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _taint(value, payload: str, keyed: bool = False):
    if isinstance(value, str):
        return value if value in _KEEP else value + payload
    if isinstance(value, list):
        return [_taint(v, payload) for v in value]
    if isinstance(value, dict):
        return {(_taint(k, payload) if keyed else k): (v if k == "format" else _taint(v, payload, k in _KEYED))
                for k, v in value.items()}
    return value


def _hostile(payload: str) -> dict:
    card = make_scorecard()
    card["metrics"][4]["not_available"] = {"candidate-merged": "not available from this engine: no logprobs"}
    card["operations"]["candidate"]["endpoint"] = {
        "api": "chat", "model": "served-model", "http_requests": 3, "retries": 1, "failed_requests": 1,
        "failures": {"timeout": 1}, "faults": {"reset": 1}, "prompt_logprobs": "available"}
    card["operations"]["candidate"]["peak_memory_note"] = "not measured: the model runs in the engine's process"
    card["models"][2]["fingerprint"]["model"] = "served-model"
    return _taint(card, payload)


@pytest.fixture(params=sorted(PAYLOADS), ids=sorted(PAYLOADS))
def hostile(request) -> tuple[str, dict]:
    return request.param, _hostile(PAYLOADS[request.param])


def _cells(html: str) -> list[int]:
    """The number of cells of every table row in rendered HTML."""
    return [len(re.findall(r"<t[dh][ >]", row)) for row in re.findall(r"<tr>(.*?)</tr>", html, re.S)]


def test_markdown_shows_every_string_as_text(hostile):
    name, card = hostile
    md = render_markdown(card)
    # Nothing a terminal acts on: `cat scorecard.md` cannot clear the screen or rewrite a line.
    assert not _CONTROLS.search(md), repr(_CONTROLS.search(md))
    assert "<" not in md  # no raw HTML, no autolink
    html = MarkdownIt("commonmark").enable("table").render(md)
    # No element the data brought: only the report's own bold verdicts and tables.
    tags = set(re.findall(r"<([a-z0-9]+)", html))
    assert tags <= {"h1", "h2", "h3", "p", "strong", "table", "thead", "tbody", "tr", "th", "td"}, tags
    assert set(re.findall(r"<strong>(.*?)</strong>", html)) <= {"PASSED", "FAILED", "FAIL"}
    # Every row of a table has as many cells as its header (a `|` or a newline splits none).
    for table in re.findall(r"<table>(.*?)</table>", html, re.S):
        counts = _cells(table)
        assert len(set(counts)) == 1, (name, counts)
    assert len(re.findall(r"<table>", html)) == md.count("\n|---")
    # The payload is there to read, as text, in the failure rows.
    if name in ("html", "markdown", "rich"):
        shown = PAYLOADS[name].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
        assert shown.split(" ")[0] in html


def test_markdown_of_a_plain_scorecard_reads_as_written():
    md = render_markdown(make_scorecard())
    assert "| tickets/task_success/exact | tool_call | 4 |" in md  # snake_case needs no escape
    assert "0.020 &lt;script>alert(1)&lt;/script> |" in md and "candidate 0.625 > base 0.125" in md
    assert "| base | hf | /runs/tiny-sft/base | cdcdcdcdcdcd |" in md


def test_md_text_truncates_before_escaping():
    assert md_text("<" * 10, 4) == "&lt;&lt;&lt;…" and md_text("ab|cd", 3) == "ab…"


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_html_page_holds_no_element_from_the_data(hostile):
    name, card = hostile
    page = render_html(card)
    plain = render_html(make_scorecard())
    parser, reference = _Elements(), _Elements()
    parser.feed(page)
    reference.feed(plain)
    count = lambda p, tag: sum(1 for t, _ in p.tags if t == tag)  # noqa: E731
    for tag in ("script", "style", "img", "a", "iframe", "object", "link", "meta"):
        assert count(parser, tag) == count(reference, tag), (name, tag)
    assert not [a for _, attrs in parser.tags for a in attrs if a.startswith("on")]
    # Attributes that load or run something hold only what the plain page holds (text in a
    # `title` or `data-*` attribute is inert and escaped).
    active = {"href", "src", "srcdoc", "action", "formaction", "style", "xlink:href", "http-equiv", "content"}
    pick = lambda p: [(t, a, v) for t, attrs in p.tags for a, v in attrs.items() if a in active]  # noqa: E731
    assert pick(parser) == pick(reference), name
    assert {a for _, attrs in parser.tags for a in attrs} == {a for _, attrs in reference.tags for a in attrs}
    assert not _CONTROLS.search(page), repr(_CONTROLS.search(page))  # newlines and tabs are text in HTML


def test_terminal_table_and_gates_print_strings_as_written(hostile, capsys, tmp_path):
    name, card = hostile
    assert _report(argparse.Namespace(json=False), card, Path(tmp_path)) == 1
    out = capsys.readouterr().out
    assert not _CONTROLS.search(out), repr(_CONTROLS.search(out))
    if name == "rich":  # markup printed as text, not applied (a bold "PASSED" with no brackets)
        assert "[bold green]PASSED[/bold green]" in out.replace("\n", "")
    if name == "terminal":
        assert "\\x1b[2J\\x1b[H\\x1b[1;32mALL" in out


def test_json_on_stdout_and_failed_gates_on_stderr(capsys, tmp_path):
    card = _hostile(PAYLOADS["terminal"] + PAYLOADS["rich"])
    assert _report(argparse.Namespace(json=True), card, Path(tmp_path)) == 1
    captured = capsys.readouterr()
    assert not _CONTROLS.search(captured.out) and not _CONTROLS.search(captured.err)
    assert json.loads(captured.out) == card
    assert "gate failed: general loss budget\\x1b[2J" in captured.err and "[bold green]PASSED" in captured.err
