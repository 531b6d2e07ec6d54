"""The HTML report, JUnit XML and markdown summary from a real history database; the report is
rendered by a real headless Chromium when one is installed (apt-get install -y chromium)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import xml.etree.ElementTree as ET
from datetime import timedelta
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_store import KEY, T0, run_inputs, synthetic_tables

from servegate.compare import compare_run
from servegate.gated_metrics import GATED_METRICS
from servegate.report import PLOT_NAMES, render_report, write_junit, write_markdown_summary, write_report
from servegate.history import GateKey, Store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Plots(HTMLParser):
    """Figures with class 'plot', whether each holds an <svg>, and anything that loads from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict] = {}
        self._open: str | None = None
        self.external: list[str] = []
        self.scripts = 0
        self.svg_count = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "figure" and "plot" in (a.get("class") or ""):
            self._open = a["data-plot"]
            self.plots[self._open] = {"svg": False, "empty": a.get("data-empty"), "paths": 0}
        elif tag == "svg":
            self.svg_count += 1
            if self._open:
                self.plots[self._open]["svg"] = True
        elif tag in ("path", "use") and self._open:
            self.plots[self._open]["paths"] += 1
        elif tag == "script":
            self.scripts += 1
        for name in ("src", "href"):
            value = a.get(name) or ""
            if value.startswith(("http:", "https:", "//", "file:")):
                self.external.append(value)

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._open = None


@pytest.fixture()
def history(tmp_path: Path) -> tuple[Store, str, Path]:
    """Four passing nights, then a night with a 30 % slower decode (recorded as the flow would:
    compare before recording, the comparison table stored with the run)."""
    store = Store(str(tmp_path / "history.db"))
    for i in range(4):
        store.record_run(**run_inputs(f"night-{i}", started_at=T0 + timedelta(days=i), seed=i))
    current = synthetic_tables(99, slowdown=1.3, occupancy=80.0)
    comparison = compare_run(store, current, KEY)
    run_dir = tmp_path / "runs" / "night-4"
    run_dir.mkdir(parents=True)
    inputs = run_inputs("night-4", started_at=T0 + timedelta(days=4), status="fail", seed=99,
                        tables={**current, "comparison": comparison})
    store.record_run(**inputs, run_dir=run_dir)
    yield store, "night-4", run_dir
    store.close()


def test_compare_run_from_the_store_matches_tables_and_first_run_is_insufficient(history) -> None:
    store, run_id, _ = history
    by_id = compare_run(store, run_id)
    recorded = store.table(run_id, "comparison")
    assert list(by_id["decision"]) == list(recorded["decision"])
    assert by_id.attrs["baseline"]["run_ids"] == ["night-3", "night-2", "night-1", "night-0"]
    regressed = set(by_id.loc[by_id["decision"] == "regression", "metric"])
    assert {"serving.ttft_ms.median", "serving.itl_ms.median", "serving.e2e_latency_ms.median",
            "occupancy.fwd_occupancy.median"} <= regressed
    first = GateKey("smoke", "embedded", "cpu", "brand-new-model")
    fresh = compare_run(store, synthetic_tables(1), first)
    assert set(fresh.loc[fresh["gated"], "decision"]) == {"insufficient_data"}


def test_report_is_self_contained_with_every_plot(history, tmp_path: Path) -> None:
    store, run_id, run_dir = history
    path = write_report(store, run_id)
    assert path == run_dir / "report.html"
    text = path.read_text(encoding="utf-8")
    parser = _Plots()
    parser.feed(text)
    assert parser.scripts == 0 and parser.external == []
    for name in PLOT_NAMES:
        assert parser.plots[name]["svg"] and parser.plots[name]["paths"] > 0, (name, parser.plots.get(name))
    trends = {n for n in parser.plots if n.startswith("trend:")}
    # The metrics the synthetic nights measured (no one-batch repeats, no capacity sweep) each get a trend.
    measured = set(synthetic_tables(0)) - {"one_batch"}
    medians = {m.metric for m in GATED_METRICS if m.statistic == "median" and m.table in measured}
    assert {t.removeprefix("trend:") for t in trends} >= medians
    assert all(parser.plots[t]["svg"] for t in trends)
    assert 'id="verdict"' in text and ">fail<" in text
    assert "contract: no failed requests" in text  # the breach with its source
    assert '<td class="bad">regression</td>' in text and "baseline ±5%" in text
    out = write_report(store, run_id, tmp_path / "elsewhere" / "r.html")
    assert out.is_file()


def test_report_without_data_says_why_instead_of_plotting(tmp_path: Path) -> None:
    with Store(str(tmp_path / "h.db")) as store:
        tables = {"serving_requests": synthetic_tables(1)["serving_requests"]}
        store.record_run(**run_inputs("lonely", started_at=T0, tables=tables, status="inconclusive"))
        text = write_report(store, "lonely", tmp_path / "r.html").read_text()
    parser = _Plots()
    parser.feed(text)
    assert parser.plots["serving_ttft_cdf"]["svg"]
    assert parser.plots["one_batch_latency"]["empty"] and not parser.plots["one_batch_latency"]["svg"]
    assert parser.plots["occupancy_over_time"]["empty"]
    assert "too little history" in text


def _run_chromium(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    # Chromium forks helpers; a new session lets a timeout end the whole tree.
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.timeout(180)
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed: apt-get install -y chromium")
def test_report_renders_in_headless_chromium(history, tmp_path: Path) -> None:
    from PIL import Image

    store, run_id, _ = history
    report = write_report(store, run_id, tmp_path / "report.html")
    base = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'chrome-profile'}"]
    dom = _run_chromium([*base, "--dump-dom", report.as_uri()], 90)
    assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-2000:]
    parser = _Plots()
    parser.feed(dom.stdout.decode())
    source = _Plots()
    source.feed(report.read_text())
    assert set(parser.plots) == set(source.plots) and parser.svg_count == source.svg_count
    assert all(p["svg"] for p in parser.plots.values())
    shot = tmp_path / "shot.png"
    res = _run_chromium([*base, f"--screenshot={shot}", "--window-size=1280,4000", "--hide-scrollbars",
                         report.as_uri()], 90)
    assert res.returncode == 0 and shot.is_file(), res.stderr.decode(errors="replace")[-2000:]
    with Image.open(shot) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1_000_000)
    assert img.size == (1280, 4000)
    assert colours is not None and len(colours) > 50  # plots drawn, not a blank page


def test_junit_has_one_case_per_expectation_and_failures_for_breaches(tmp_path: Path) -> None:
    inputs = run_inputs("x", started_at=T0, status="fail")
    relative = {"table": "comparison", "expectation_type": "expect_column_values_to_not_be_in_set",
                "column": "decision", "kwargs": {"value_set": ["regression"]}, "success": False,
                "observed": {"unexpected_values": ["regression"]}, "allowed": "not in [regression]",
                "meta": {"source": "baseline-relative bound"}}
    outcomes = inputs["outcomes"] + [relative]
    verdict = {**inputs["verdict"], "infra_errors": ["occupancy: /metrics missing sglang:fwd_occupancy"]}
    path = write_junit(verdict, outcomes, tmp_path / "junit" / "servegate.xml")
    root = ET.parse(path).getroot()
    assert root.tag == "testsuite" and root.get("tests") == "4"
    assert root.get("failures") == "2" and root.get("skipped") == "1" and root.get("errors") == "1"
    cases = root.findall("testcase")
    assert [c.get("classname") for c in cases] == ["servegate.serving_summary", "servegate.occupancy_summary",
                                                   "servegate.comparison", "servegate.infra"]
    failure = cases[0].find("failure")
    assert failure is not None and "observed 3" in failure.get("message") and "no failed requests" in failure.text
    assert cases[1].find("skipped").get("message") == "table not produced"
    assert cases[3].find("error").text.startswith("occupancy: /metrics")


def test_markdown_summary(history, tmp_path: Path) -> None:
    store, run_id, _ = history
    rec = store.get_run(run_id)
    comparison = store.table(run_id, "comparison")
    text = write_markdown_summary(rec.verdict, store.outcomes(run_id), comparison, run_id=run_id, key=str(rec.key),
                                  report_path="report.html", path=tmp_path / "summary.md")
    assert (tmp_path / "summary.md").read_text() == text
    assert text.startswith("## servegate: **fail** (exit 1) — `smoke/embedded/cpu/smollm2-135m`\n")
    assert "### Breaches" in text
    assert text.rstrip().endswith("### Links\n- [HTML report](<report.html>)")  # links last


def _table(text: str, heading: str) -> list[list[str]]:
    """The body rows of the Markdown table under ``heading``, as cells (escaped pipes kept in a cell)."""
    section = text.split(f"\n{heading}\n", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def test_markdown_summary_leads_with_the_verdict_and_a_key_metric_table(history) -> None:
    """The summary a CI page shows: the verdict line, then one row per threshold check and per gated
    comparison (value vs baseline, ratio [interval] vs bound, decision), then breaches and links; the
    gated rows are not repeated in the comparison table, and a note shared by rows is said once."""
    store, run_id, _ = history
    rec = store.get_run(run_id)
    text = write_markdown_summary(rec.verdict, store.outcomes(run_id), store.table(run_id, "comparison"),
                                  run_id=run_id, key=str(rec.key), report_path="report.html")
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert headings == ["## servegate: **fail** (exit 1) — `smoke/embedded/cpu/smollm2-135m`", "### Key metrics",
                        "### Breaches", "### Comparison with the baseline", "### Links"]
    rows = {row[1]: row for row in _table(text, "### Key metrics")}
    # The breach: the threshold check with the value it saw.
    assert rows["serving_summary.failed"] == ["**FAIL**", "serving_summary.failed", "3", "<= 0", "threshold"]
    # A gated comparison row: current vs baseline median, ratio and interval against the bound, decision.
    itl = rows["serving.itl_ms.median"]
    assert itl[0] == "**FAIL**" and itl[4] == "baseline: regression"
    assert re.fullmatch(r"[\d.]+ vs [\d.]+", itl[2]), itl
    assert re.fullmatch(r"×1\.\d{4} \\\[1\.\d{4}, 1\.\d{4}\\\] vs bound 5\.0%", itl[3]), itl
    ratio, low, high = (float(x) for x in re.findall(r"\d+\.\d{4}", itl[3]))
    assert 1.2 < low <= ratio <= high < 1.4  # the 30 % slower decode
    assert list(rows) == ["serving_summary.failed", "serving.ttft_ms.median", "serving.itl_ms.median",
                          "serving.tpot_ms.median", "serving.e2e_latency_ms.median", "serving.itl_ms.p99",
                          "occupancy.fwd_occupancy.median"]
    others = _table(text, "Reported, not gated:")
    assert {row[0] for row in others}.isdisjoint(rows)  # a gated metric said once
    assert text.count("1 sample(s) in this run, 3 needed") == 1  # the shared note, once
    assert sum(row[-1] == "note 2" for row in others) == 8


# ---- the report at phone and desktop width (headless Chromium through Playwright) -----------
PW_CHROMIUM = os.environ.get("SERVEGATE_CHROMIUM", "/usr/bin/chromium")


def _playwright_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not Path(PW_CHROMIUM).is_file():
        return f"no Chromium at {PW_CHROMIUM} (apt-get install chromium, or set SERVEGATE_CHROMIUM)"
    return None


_PW_MISSING = _playwright_missing()
if os.environ.get("CI") == "true" and _PW_MISSING:
    raise RuntimeError(f"CI=true but {_PW_MISSING}; CI must run `bash scripts/setup.sh --tests`, which installs both")

_LAYOUT_JS = """() => ({
  scrollWidth: document.documentElement.scrollWidth,
  imgs: [...document.images].map(i => ({src: i.src.slice(0, 60), ok: i.complete && i.naturalWidth > 0})),
  svgs: [...document.querySelectorAll('figure.plot svg')].map(s => s.getBoundingClientRect().width),
  stages: [...document.querySelectorAll('h3.stage')].map(h => h.id),
  notes: [...document.querySelectorAll('p.note')].map(p => p.textContent),
  cells: [...document.querySelectorAll('table.comparison td')].map(td => td.textContent),
})"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(_PW_MISSING is not None, reason=_PW_MISSING or "")
def test_report_reads_at_phone_and_desktop_width(history, tmp_path: Path) -> None:
    """The report in a real browser at 390 px (a phone) and 1400 px: no sideways scrolling of the
    page at phone width (wide tables scroll in their own box), every plot and image drawn, no
    console error, the comparison rows under one heading per stage, and a note shared by rows
    (one-batch cases measured once) said once above the tables instead of on each row."""
    from PIL import Image
    from playwright.sync_api import sync_playwright

    store, run_id, _ = history
    report = write_report(store, run_id, tmp_path / "report.html")
    errors: list[str] = []
    seen: dict[int, dict] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=PW_CHROMIUM, args=["--no-sandbox"])
        try:
            for width in (390, 1400):
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(report.as_uri(), wait_until="load")
                seen[width] = page.evaluate(_LAYOUT_JS)
                shot = tmp_path / f"report-{width}.png"
                page.screenshot(path=str(shot), full_page=True)
                page.close()
        finally:
            browser.close()
    assert errors == []
    for width, layout in seen.items():
        shot = tmp_path / f"report-{width}.png"
        with Image.open(shot) as img:
            assert img.size[0] == width and img.size[1] > 900, img.size  # the whole page, taller than a screen
            colours = img.convert("RGB").getcolors(maxcolors=1_000_000)
        assert colours is not None and len(colours) > 50, width  # plots drawn, not a blank page
        assert all(i["ok"] for i in layout["imgs"]), layout["imgs"]
        assert layout["svgs"] and all(0 < w <= width for w in layout["svgs"]), (width, layout["svgs"])
    assert seen[390]["scrollWidth"] <= 390 + 2, seen[390]["scrollWidth"]
    stages = seen[1400]["stages"]
    assert stages == ["breaches-serving", "comparison-one_batch", "comparison-serving", "comparison-occupancy"]
    note = "1 sample(s) in this run, 3 needed; repeat each case to gate it"
    assert report.read_text().count(note) == 1
    assert [n for n in seen[1400]["notes"] if note in n] == [f"Note 2 (8 rows): {note}"]
    assert seen[1400]["cells"].count("see note 2") == 8 and note not in seen[1400]["cells"]


# ---- untrusted text in the outputs (issue 11, finding 15b) ----------------------------------
HOSTILE = ("<script>alert(1)</script><img src=x onerror=alert(2)> | `cmd` [x](http://evil.example)"
           "\nsecond line")


def _hostile_verdict() -> dict:
    breach = {"table": "serving_summary", "expectation": "expect_column_values_to_be_between",
              "column": "failed", "observed": HOSTILE, "allowed": "<= 0", "source": HOSTILE}
    return {"status": "inconclusive", "reason": HOSTILE, "breaches": [breach], "infra_errors": [HOSTILE]}


def test_summary_md_renders_server_text_as_text(tmp_path: Path) -> None:
    """A server's error body went into summary.md as raw HTML (a CI page or Prefect renders it)."""
    text = write_markdown_summary(_hostile_verdict(), key="smoke/x`y|z", run_id="r`1",
                                  report_path=tmp_path / "a dir (1)" / "report.html", path=tmp_path / "summary.md")
    assert "<script" not in text and "<img" not in text
    assert "&lt;script>alert(1)&lt;/script>&lt;img src=x onerror=alert(2)>" in text
    assert "[x](http" not in text and "\\[x\\](http://evil.example)" in text  # no link
    breach_row = next(line for line in text.splitlines() if line.startswith("| serving_summary"))
    assert len(re.findall(r"(?<!\\)\|", breach_row)) == 7  # six cells: the pipe in the text is escaped
    assert "\\`cmd\\`" in breach_row  # no code span
    infra = text.split("### Infrastructure errors (could not decide)\n", 1)[1].splitlines()[0]
    assert infra.startswith("- &lt;script>") and infra.endswith("second line")  # one list item
    assert "— ``smoke/x`y|z``" in text and "Run ``r`1``" in text  # code spans the value cannot close
    assert f"[HTML report](<{tmp_path / 'a dir (1)' / 'report.html'}>)" in text


def test_summary_md_rendered_by_a_markdown_engine_shows_the_text_and_no_tag(tmp_path: Path) -> None:
    """Rendered as a CI page renders it (CommonMark + GFM tables, raw HTML allowed)."""
    markdown_it = pytest.importorskip("markdown_it")
    text = write_markdown_summary(_hostile_verdict(), key="k", run_id="r")
    rendered = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(text)

    class Tags(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: list[str] = []
            self.cells: list[int] = []
            self.text: list[str] = []

        def handle_starttag(self, tag: str, attrs: list) -> None:
            self.tags.append(tag)
            if tag == "tr":
                self.cells.append(0)
            elif tag == "td":
                self.cells[-1] += 1

        def handle_data(self, data: str) -> None:
            self.text.append(data)

    tags = Tags()
    tags.feed(rendered)
    assert not {"script", "img", "a"} & set(tags.tags), sorted(set(tags.tags))
    assert tags.tags.count("code") == 2  # the key and the run id, none from the server's text
    assert tags.cells[1] == 6  # the breach row: six cells
    assert "<script>alert(1)</script><img src=x onerror=alert(2)> | `cmd` [x](http://evil.example)" in "".join(tags.text)


def test_report_html_escapes_server_text(tmp_path: Path) -> None:
    html_text = render_report(run_id="r<1>", key="smoke/<b>x</b>", verdict=_hostile_verdict(), tables={})
    parser = _Plots()
    parser.feed(html_text)
    assert parser.scripts == 0 and parser.external == []
    assert "<img" not in html_text and "<b>x</b>" not in html_text
    assert html_text.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 3  # breach observed, source, infra error


def test_report_shows_speculation_next_to_itl_only_when_the_run_speculated(history, tmp_path: Path) -> None:
    import numpy as np
    import pandas as pd

    tables = synthetic_tables(7)
    samples = tables["occupancy_samples"]
    # The worker's windowed gauge: 1 (a stale window from the previous stage), then 3 to 5
    samples["spec_accept_length"] = np.r_[1.0, np.tile([3.0, 4.0, 5.0, 4.0], 10)[:len(samples) - 1]]
    tables["occupancy_summary"] = pd.DataFrame([{"n_samples": len(samples), "spec_accept_length_median": 4.0,
                                                 "speculative_decoding": True}])
    with Store(str(tmp_path / "spec.db")) as store:
        store.record_run(**run_inputs("spec-night", started_at=T0, tables=tables))
        text = write_report(store, "spec-night", tmp_path / "spec.html").read_text()
    parser = _Plots()
    parser.feed(text)
    plot = parser.plots["speculation_over_time"]
    assert plot["svg"] and plot["paths"] > 0 and not plot["empty"]
    figure = text[text.index('data-plot="speculation_over_time"'):]
    figure = figure[:figure.index("</figure>")]
    assert "median 4.00" in figure  # the accept-length panel, from the scraped samples
    assert "serving stage: inter-token latency" in figure and "ITL (ms)" in figure
    assert all(parser.plots[name]["svg"] for name in PLOT_NAMES if name != "one_batch_latency")

    # The history fixture's run did not speculate (no accept length): no speculation plot at all.
    store, run_id, _ = history
    parser = _Plots()
    parser.feed(write_report(store, run_id, tmp_path / "plain.html").read_text())
    assert "speculation_over_time" not in parser.plots
