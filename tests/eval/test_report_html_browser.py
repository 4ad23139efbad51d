"""The HTML scorecard in a real browser: Debian's chromium driven by Playwright (the system
browser; `make test` installs it, nothing is downloaded). The page renders, the charts are
drawn (one mark of non-zero size per value), the failure browser filters by set, category,
model, result and text, nothing is fetched, nothing logs an error, and an output that holds
`<script>` is shown as text, not run.

Chromium or Playwright missing is a failure, not a skip: the project's set-up must install
both. Only platforms other than Linux skip.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from glmtune.eval.report_html import render_html
from tests.eval.report_fixture import ADVERSARIAL, make_scorecard

if not sys.platform.startswith("linux"):
    pytest.skip("the browser test runs on Linux (Debian's chromium)", allow_module_level=True)


def _chromium() -> str:
    path = os.environ.get("GLMTUNE_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("chromium is not installed: `make test` installs it (apt-get install -y chromium)", pytrace=False)
    return path


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright's Python package is missing: `make test` installs the dev extra", pytrace=False)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=_chromium())
        yield b
        b.close()


class Opened:
    """A page opened from disk, with every console message, page error and request recorded."""

    def __init__(self, browser, path: Path, fragment: str = ""):
        self.url = path.as_uri()
        self.console, self.errors, self.requests = [], [], []
        self.page = browser.new_page(viewport={"width": 1360, "height": 900})
        self.page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.route("**/*", self._only_the_page)
        self.page.goto(self.url + fragment)

    def _only_the_page(self, route):
        """Any request other than the page itself is refused (and recorded by the listener)."""
        if route.request.url.split("#")[0] == self.url:
            route.continue_()
        else:
            route.abort()

    def visible_rows(self) -> int:
        return self.page.locator("#ex-list article.ex:visible").count()

    def select(self, **values: str) -> int:
        for name, value in values.items():
            if name == "text":
                self.page.fill("#f-text", value)
            else:
                self.page.select_option(f"#f-{name}", value)
        rows = self.visible_rows()
        assert self.page.get_attribute("#counts", "data-matched") == str(rows)  # under one page of 50
        return rows

    def assert_clean(self):
        assert self.errors == [] and self.console == [], (self.errors, self.console)
        assert self.requests == [self.url], self.requests  # the document itself, nothing else


@pytest.fixture(scope="module")
def card() -> dict:
    return make_scorecard(2)


@pytest.fixture(scope="module")
def opened(browser, card, tmp_path_factory) -> Opened:
    path = tmp_path_factory.mktemp("report") / "scorecard.html"
    path.write_text(render_html(card), encoding="utf-8")
    return Opened(browser, path)


def test_renders_and_injected_script_does_not_run(opened, tmp_path_factory):
    page = opened.page
    assert page.title() == "Scorecard: support-json v1 — FAIL"
    assert page.locator("#gates table.gates tbody tr").count() == 4
    assert page.locator("#gates .pill.fail").all_inner_texts() == ["FAIL"]
    assert page.locator("header .badge").inner_text().split("\n")[0] == "FAIL"
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("script").count() == 1
    assert page.locator("#ex-list pre", has_text=ADVERSARIAL).count() == 1  # shown as text
    shot = tmp_path_factory.mktemp("screenshot") / "scorecard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 50_000
    print(f"screenshot: {shot}")
    opened.assert_clean()


def test_charts_are_drawn(opened, card):
    page = opened.page
    bars = page.locator("svg.chart rect.bar")
    sizes = bars.evaluate_all("els => els.map(e => { const b = e.getBoundingClientRect(); return [b.width, b.height]; })")
    values = [v for m in card["metrics"] for cell in m["by_category"].values() for v in cell["values"].values()]
    values += [v for f in card["fields"] for v in f["values"].values()]
    assert len(sizes) == sum(v is not None for v in values)
    assert all(w > 10 and h >= 1 for w, h in sizes), sizes
    # Bars scale with their values: the task-success chart's 'all' group, per model.
    exact = card["metrics"][0]["by_category"]["all"]["values"]
    heights = page.locator("#chart-0-0 rect.bar[data-category='all']").evaluate_all(
        "els => els.map(e => [e.dataset.model, e.getBoundingClientRect().height])")
    ratio = {m: h / 150 for m, h in heights}  # the plot is 150 px tall, 0..100%
    assert ratio == pytest.approx(exact, abs=0.02)
    assert page.locator("svg.chart text.na").count() == sum(v is None for v in values)
    dots = page.locator("#chart-latency circle.pt")
    assert dots.count() == sum(len(o["latency_s"]) for o in card["operations"].values())
    assert page.locator("#chart-latency line.p50").count() == page.locator("#chart-latency line.p95").count() == 3
    assert all(b["width"] > 0 for b in (dots.nth(i).bounding_box() for i in range(3)))


def test_filters(opened, card):
    examples = card["examples"]

    def expected(pred) -> int:
        return sum(1 for e in examples if pred(e))

    failed = lambda e, m: e["outputs"][m]["passed"] is False  # noqa: E731
    assert opened.visible_rows() == len(examples)
    assert opened.select(set="refusal") == expected(lambda e: e["set"] == "refusal") == 6
    assert opened.select(set="", category="tool_call") == expected(lambda e: e["category"] == "tool_call") == 4
    assert opened.select(category="", model="candidate", status="failed") == expected(lambda e: failed(e, "candidate"))
    assert opened.page.locator(".col.out.focus:visible").count() == opened.visible_rows()
    assert opened.select(model="", status="regressed") == expected(
        lambda e: e["outputs"]["base"]["passed"] and any(failed(e, m) for m in ("candidate", "candidate-merged")))
    assert opened.select(status="passed") == expected(lambda e: all(o["passed"] for o in e["outputs"].values()))
    assert opened.select(status="", text="ORD-1002") == 1
    assert opened.select(text="pwned") == 1
    assert opened.select(text="") == len(examples)
    # A category under a chart opens the browser on that set and category; the URL keeps it.
    opened.page.click("#chart-0-0 text.xlab[data-category='billing']")
    assert opened.page.input_value("#f-set") == "tickets" and opened.page.input_value("#f-category") == "billing"
    assert opened.visible_rows() == expected(lambda e: e["category"] == "billing")
    assert opened.page.evaluate("location.hash") == "#set=tickets&category=billing"
    opened.select(set="", category="")
    opened.assert_clean()


def test_link_opens_filtered_with_one_candidate(browser, tmp_path):
    card = make_scorecard(1)
    path = tmp_path / "scorecard.html"
    path.write_text(render_html(card), encoding="utf-8")
    opened = Opened(browser, path, "#set=tickets&model=candidate&status=failed")
    want = sum(1 for e in card["examples"] if e["set"] == "tickets" and e["outputs"]["candidate"]["passed"] is False)
    assert opened.visible_rows() == want and opened.page.input_value("#f-status") == "failed"
    assert opened.page.locator("th", has_text="candidate-merged").count() == 0
    assert opened.page.evaluate("window.__pwned") is None
    opened.assert_clean()


def test_long_suite_shows_pages(browser, tmp_path):
    card = make_scorecard(1)
    first = card["examples"][0]
    card["examples"] = [{**first, "id": f"row-{i:03d}"} for i in range(120)]
    path = tmp_path / "scorecard.html"
    path.write_text(render_html(card), encoding="utf-8")
    opened = Opened(browser, path)
    assert opened.visible_rows() == 50 and opened.page.inner_text("#counts").startswith("Showing 50 of 120")
    opened.page.click("#more")
    opened.page.click("#more")
    assert opened.visible_rows() == 120 and opened.page.locator("#more").is_hidden()
    assert opened.select(text="row-11") == 10  # row-110 .. row-119
    opened.assert_clean()
