"""The HTML scorecard without a browser: structure, escaping of model output, the page's
Content-Security-Policy, null and missing values, one or two candidates, value formatting.
(tests/eval/test_report_html_browser.py opens the page in chromium.)"""

from __future__ import annotations

import base64
import hashlib
import re
from html.parser import HTMLParser

import pytest

from glmtune.eval.report_charts import _ticks, delta_class, fmt_delta, fmt_value
from glmtune.eval.report_html import render_html
from tests.eval.report_fixture import ADVERSARIAL, make_scorecard


class _Page(HTMLParser):
    """Start tags with their attributes, the text under each tag name, and raw element bodies."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.raw: dict[str, list[str]] = {"script": [], "style": []}
        self.text: list[str] = []
        self.inside: str | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.inside = tag if tag in self.raw else None

    def handle_endtag(self, tag):
        self.inside = None

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        if self.inside:
            self.raw[self.inside].append(data)
        self.text.append(data)

    def find(self, tag: str, cls: str | None = None) -> list[dict]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in (a.get("class") or "").split())]


@pytest.fixture(scope="module")
def two() -> tuple[dict, str]:
    card = make_scorecard(2)
    return card, render_html(card)


def _non_null_values(card: dict) -> int:
    return sum(v is not None for m in card["metrics"] for cell in m["by_category"].values()
               for v in cell["values"].values())


def test_structure(two):
    card, html = two
    page = _Page(html)
    title = "".join(re.findall(r"<title>(.*?)</title>", html, re.S)[:1])
    assert "support-json" in title and "FAIL" in title
    gate_rows = re.findall(r'<tr class="(ok|no)">', html)
    assert gate_rows == ["ok", "ok", "no", "ok"]
    assert len(page.find("article", "ex")) == len(card["examples"]) == 22
    # One bar per non-null value: every metric x category x model, and the per-field chart.
    field_values = sum(v is not None for f in card["fields"] for v in f["values"].values())
    assert len(page.find("rect", "bar")) == _non_null_values(card) + field_values
    assert len(page.find("svg", "chart")) == len(card["metrics"]) + 2  # + per-field + latency
    assert len(page.find("circle", "pt")) == sum(len(o["latency_s"]) for o in card["operations"].values())
    assert len(page.find("line", "p50")) == len(page.find("line", "p95")) == 3
    # Every example row carries its set/category and each model's result for the filters.
    sets = {a["data-set"] for a in page.find("article", "ex")}
    assert sets == {"tickets", "refusal"}
    for name in ("candidate", "candidate-merged", "Δ candidate", "Δ candidate-merged"):
        assert f"{name}</th>" in html
    assert "−16.7 pp" in html and "+0.040" in html  # deltas with direction


def test_self_contained(two):
    _, html = two
    page = _Page(html)
    assert not page.find("link") and not page.find("img") and not page.find("iframe")
    assert all("src" not in a and not (a.get("href") or "#").startswith(("http", "//")) for _, a in page.tags)
    assert "@import" not in html and "url(" not in html
    assert len(page.find("script")) == 1 and len(page.find("style")) == 1


def test_model_output_is_escaped(two):
    _, html = two
    page = _Page(html)
    text = "".join(page.text)
    assert ADVERSARIAL in text  # shown verbatim, as text
    assert "<script>window.__pwned" not in html and "&lt;script&gt;window.__pwned" in html
    assert "<script>alert(1)" not in html  # a gate message
    assert "I am sorry <b>bold</b> &amp; not JSON" in text  # entities round-trip as written
    # The only script and style are the page's own, and the policy allows exactly those.
    csp = next(a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    for kind in ("script", "style"):
        body = "".join(page.raw[kind])
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"{kind}-src 'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp


def test_one_candidate():
    card = make_scorecard(1)
    html = render_html(card)
    assert "candidate-merged" not in html
    page = _Page(html)
    assert len(page.find("rect", "bar")) == _non_null_values(card) + sum(
        v is not None for f in card["fields"] for v in f["values"].values())
    assert [a["value"] for a in page.find("option") if a.get("value") in ("regressed", "fixed")] == ["regressed", "fixed"]
    assert html.count("Δ candidate</th>") == 1


def test_missing_sections_and_nulls():
    html = render_html({"format": "glmtune.scorecard/1"})
    assert "The suite defines no gates." in html and "No operations recorded." in html
    assert "0 examples" in html
    card = make_scorecard(1)
    card["operations"]["candidate"]["latency_s"] = []
    card["operations"]["base"] = None
    card["examples"][0]["outputs"]["candidate"] = None
    card["examples"][1]["outputs"]["base"].update(text=None, tool_calls=None, failures=None, passed=None)
    card["metrics"][0]["by_category"]["all"] = {"n": None, "values": {"base": None}, "delta": {}}
    card["models"][1]["fingerprint"] = None
    card["passed"] = None
    html = render_html(card)
    assert "no latency recorded" in html and "not evaluated" in html and "(no output)" in html
    assert '<span class="verdict fail">FAIL</span>' in html  # an unknown result is never shown as a pass


def test_passing_scorecard():
    card = make_scorecard(1)
    card["gates"] = [g for g in card["gates"] if g["passed"]]
    card["passed"] = True
    html = render_html(card)
    assert '<span class="verdict pass">PASS</span>' in html and "3 of 3 gates passed" in html
    assert "— PASS</title>" in html


def test_wrong_format_is_refused():
    with pytest.raises(ValueError, match="glmtune.scorecard/1"):
        render_html({"format": "something/2"})
    with pytest.raises(ValueError, match="format"):
        render_html([])


def test_deterministic(two):
    card, html = two
    assert render_html(make_scorecard(2)) == html


def test_formatting():
    assert fmt_value(0.125, "ratio") == "12.5%" and fmt_value(None, "ratio") == "—"
    assert fmt_value(0.2134, "seconds") == "0.213 s" and fmt_value(3, "count") == "3"
    assert fmt_value(1234.5, "tokens_per_s") == "1,234.5 tok/s" and fmt_value(2.3456, "nats_per_token") == "2.346"
    assert fmt_delta(0.125, "ratio") == "+12.5 pp" and fmt_delta(-0.04, "nats_per_token") == "−0.040"
    assert fmt_delta(0.0, "count") == "±0" and fmt_delta(None, "ratio") == "—"
    assert delta_class(0.1, True) == "good" and delta_class(0.1, False) == "bad"
    assert delta_class(-0.1, False) == "good" and delta_class(0.1, None) == "same" and delta_class(0, True) == "same"
    assert _ticks(0, 0.7, "ratio") == (0.0, 1.0, 0.25)
    assert _ticks(0, 2.39, "nats_per_token") == (0.0, 3.0, 1.0)
    assert _ticks(0, 1, "count") == (0.0, 1.0, 1.0)  # whole steps for counts
    assert _ticks(-0.3, 0.5, "ratio") == pytest.approx((-0.4, 0.6, 0.2))
    assert _ticks(0, 0, "seconds") == (0.0, 1.0, 0.25)
