"""The decision section of the reports (glmtune/decide/report.py, the preface hook of
glmtune/eval/report_html.py): shown first in decision.md and decision.html, every string escaped as
the scorecard's (a model's markup is text, a terminal escape is shown escaped), and no API key in
anything rendered (redacted)."""

from __future__ import annotations

from glmtune.decide.report import REDACTED, redact, render_preface_markdown
from glmtune.eval.report_html import render_html
from tests.eval.report_fixture import ADVERSARIAL, make_scorecard

SECTION = {"title": "Decision: use retrieval: the retrieval arm passes every gate (2 of 2)",
           "paragraphs": ["Rule 3: the retrieval arm passes every gate (exit status 0).", "\x1b[2Jcleared"],
           "tables": [{"caption": "Arms", "columns": ["arm", "what"], "rows": [["retrieval", ADVERSARIAL]]}]}


def test_the_html_page_shows_the_decision_first_escaped():
    page = render_html(make_scorecard(1), SECTION)
    assert page.index('id="preface"') < page.index('id="gates"')
    assert "Decision: use retrieval" in page and "<script>window.__pwned" not in page
    assert "&lt;script&gt;window.__pwned" in page and "\\x1b[2Jcleared" in page and "\x1b" not in page
    assert 'id="preface"' not in render_html(make_scorecard(1))  # eval's page is unchanged without one


def test_the_markdown_section_is_escaped():
    text = render_preface_markdown(SECTION)
    assert text.startswith("# Decision: use retrieval: the retrieval arm passes every gate (2 of 2)\n")
    assert "<script>" not in text and "&lt;script" in text and "\x1b" not in text
    assert "| retrieval | " in text


def test_redaction_reaches_every_string_keys_included():
    value = {"sk-123 key": ["a sk-123 b", {"x": "sk-123"}], "n": 1}
    assert redact(value, ["sk-123"]) == {f"{REDACTED} key": [f"a {REDACTED} b", {"x": REDACTED}], "n": 1}
