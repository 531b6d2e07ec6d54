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
    assert text.startswith("## servegate: **fail** — `smoke/embedded/cpu/smollm2-135m`")
    assert "[HTML report](<report.html>)" in text and "### Breaches" in text
    assert "| serving.itl_ms.median |  |" in text and "**regression**" in text


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
