"""The dashboard on a 32-run history of two gate keys written through the real Store API, with
a creep (2 %/run from run 20) injected in one key's inter-token latency and a step (+15 % at run
15) in the other's TTFT: the real CLI writes the site, headless Chromium (Playwright) loads every
page, checks plots, links and the change-point marks, and screenshots the index at phone and
desktop width; ``servegate status`` names the latest change point after the baseline.

Playwright drives the system Chromium (``/usr/bin/chromium``; no browser download). Under
``CI=true`` a missing Playwright or Chromium is an error, not a skip (scripts/setup.sh installs both).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import pandas as pd
import pytest

from servegate.baseline import mark_distribution_change, pin
from servegate.compare import compare_tables
from servegate.history import GateKey, Store
from servegate.report import write_report

CHROMIUM = os.environ.get("SERVEGATE_CHROMIUM", "/usr/bin/chromium")
N_RUNS = 32
T0 = datetime(2026, 10, 1, 2, 0, tzinfo=timezone.utc)
CREEP_KEY = GateKey("nightly", "embedded", "cpu", "smollm2-135m")
STEP_KEY = GateKey("nightly", "vllm", "h100", "meta-llama/Llama-3.1-8B-Instruct")
CREEP_AT, STEP_AT = 20, 15
COMPARED_RUNS = 6


def _playwright_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM} (apt-get install chromium, or set SERVEGATE_CHROMIUM)"
    return None


_MISSING = _playwright_missing()
if os.environ.get("CI") == "true" and _MISSING:
    raise RuntimeError(f"CI=true but {_MISSING}; CI must run `bash scripts/setup.sh --tests`, which installs both")
needs_browser = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")


def run_id(key: GateKey, i: int) -> str:
    return f"{key.workload}-{key.engine}-{i:02d}"


def tables_for(rng: np.random.Generator, ttft_level: float, itl_level: float, n: int = 48) -> dict[str, pd.DataFrame]:
    """A run's serving tables (docs/contracts.md "Tables"), samples around the given medians."""
    itls = [list(rng.lognormal(np.log(itl_level), 0.1, 8)) for _ in range(n)]
    ttft = rng.lognormal(np.log(ttft_level), 0.1, n)
    requests = pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "input_tokens": np.full(n, 128), "output_tokens": np.full(n, 8),
        "scheduled_send_s": np.linspace(0, 4, n), "actual_send_s": np.linspace(0, 4, n) + 0.001,
        "dispatch_lag_ms": np.full(n, 1.0), "ttft_ms": ttft, "e2e_latency_ms": ttft + np.array([sum(x) for x in itls]),
        "tpot_ms": np.array([np.mean(x) for x in itls]), "itls_ms": itls, "success": np.ones(n, dtype=bool),
        "error": [None] * n})
    summary = pd.DataFrame([{"completed": n, "failed": 0, "median_ttft_ms": float(np.median(ttft)),
                             "client_fell_behind": False}])
    return {"serving_requests": requests, "serving_summary": summary}


def record_history(store: Store, runs_root: Path) -> None:
    """32 nightly runs per key, recorded as the gate's record task does (Store.record_run)."""
    for key, seed in ((CREEP_KEY, 1), (STEP_KEY, 2)):
        rng = np.random.default_rng(seed)
        passing: list[tuple[str, dict[str, pd.DataFrame]]] = []
        for i in range(N_RUNS):
            night = 1 + rng.normal(0, 0.02)  # run-to-run noise of 2 %
            itl, ttft = 40.0 * night, 120.0 * (1 + rng.normal(0, 0.02))
            status = "pass"
            if key == CREEP_KEY and i >= CREEP_AT:
                itl *= 1.02 ** (i - CREEP_AT + 1)
            if key == STEP_KEY and i >= STEP_AT:
                ttft *= 1.15
                status = "fail"  # the compare stage catches a step the night it lands
            started = T0 + timedelta(days=i, minutes=7 * (key == STEP_KEY))
            rid = run_id(key, i)
            run_dir = runs_root / rid
            run_dir.mkdir(parents=True)
            manifest = {"schema_version": "1", "run_id": rid, "gate": key.workload, "engine": key.engine,
                        "hardware": key.hardware, "model": key.model, "seeds": {"serving": i},
                        "servegate_version": "0.1.0", "git_revision": f"rev{i}", "git_dirty": False,
                        "host": {"hostname": "ci-1"}, "started_at": started.isoformat(), "stages": []}
            config = {"name": key.workload, "hardware": key.hardware,
                      "worker": {"engine": key.engine, "model": key.model}}
            verdict = {"status": status, "breaches": [], "infra_errors": []}
            tables = tables_for(rng, ttft, itl)
            if key == STEP_KEY and i >= N_RUNS - COMPARED_RUNS:
                # the latest nightlies compared with their baseline (the real compare stage): recorded bands
                tables["comparison"] = compare_tables(tables, passing[-5:], baseline_policy="last 5 passing")
            store.record_run(manifest, config, tables, [], verdict, run_dir=run_dir)
            if status == "pass":
                passing.append((rid, tables))
    # A pinned baseline (run 3) for the creeping key, a distribution change (before run 8) for the other.
    pin(store, run_id(CREEP_KEY, 3), reason="known-good <b>release</b> build", actor="$ops$")
    mark_distribution_change(store, STEP_KEY, reason="driver update & new <kernel>", actor="rm",
                             at=T0 + timedelta(days=7, hours=12))


def write_reports(db: Path) -> list[str]:
    """The real report (what `servegate report` writes: servegate.report.write_report, here in this
    process; the command itself is test_report's subject) for the latest run of each key and the runs at
    the injected changes (the other runs have no report file: their points must not link)."""
    ids = [run_id(CREEP_KEY, N_RUNS - 1), run_id(STEP_KEY, N_RUNS - 1), run_id(CREEP_KEY, CREEP_AT),
           run_id(STEP_KEY, STEP_AT)]
    with Store(str(db)) as store:
        for rid in ids:
            assert write_report(store, rid, None).is_file()
    return ids


def servegate(*args: str, db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servegate", *args, "--db", str(db)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("dashboard")
    db = root / "history.db"
    with Store(str(db)) as store:
        record_history(store, root / "runs")
    reported = write_reports(db)
    out = servegate("dashboard", "--out", str(root / "site"), db=db)
    assert out.returncode == 0, out.stderr
    assert "2 gate key(s)" in out.stdout
    return {"root": root, "db": db, "out": root / "site", "reported": reported}


def test_status_names_the_latest_change_point_after_the_baseline(site: dict) -> None:
    out = servegate("status", "--json", db=site["db"])
    assert out.returncode == 0, out.stderr
    rows = {r["key"]: r for r in json.loads(out.stdout)}
    creep = rows[str(CREEP_KEY)]["change_point"]
    assert creep is not None and creep["metric"] in ("serving.itl_ms.median", "serving.tpot_ms.median",
                                                     "serving.e2e_latency_ms.median")
    began = int(creep["run_id"].rsplit("-", 1)[1])
    assert abs(began - CREEP_AT) <= 2 and creep["kind"] == "trend" and creep["worse"] and creep["change"] > 0.1
    step = rows[str(STEP_KEY)]["change_point"]
    assert step is not None and step["metric"] in ("serving.ttft_ms.median", "serving.e2e_latency_ms.median")
    assert abs(int(step["run_id"].rsplit("-", 1)[1]) - STEP_AT) <= 1 and step["kind"] == "step"
    assert rows[str(STEP_KEY)]["baseline"]["policy"] == "last 5 passing"  # from the recorded comparison
    text = servegate("status", db=site["db"]).stdout
    assert f"change point: {creep['metric']}" in text and creep["run_id"] in text and step["run_id"] in text
    # A distribution change recorded between the runs around the step accepts it: no longer named.
    with Store(str(site["db"])) as store:
        mark_distribution_change(store, STEP_KEY, reason="new engine version", actor="rm",
                                 at=T0 + timedelta(days=STEP_AT - 1, hours=12))
    try:
        rows = {r["key"]: r for r in json.loads(servegate("status", "--json", db=site["db"]).stdout)}
        assert rows[str(STEP_KEY)]["change_point"] is None
        assert rows[str(CREEP_KEY)]["change_point"]["run_id"] == creep["run_id"]
    finally:  # the site fixture's database is shared: take the action back out
        import sqlalchemy as sa
        with Store(str(site["db"])) as store, store.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM baseline_actions WHERE reason = 'new engine version'"))


def test_dashboard_refuses_bad_input_with_what_to_do(site: dict, tmp_path: Path) -> None:
    out = servegate("dashboard", "--out", str(tmp_path / "s"), "--key", "no-such-gate", db=site["db"])
    assert out.returncode == 2 and "no recorded run matches --key" in out.stderr and str(CREEP_KEY) in out.stderr
    out = servegate("dashboard", "--out", str(tmp_path / "s"), "--since", "last tuesday", db=site["db"])
    assert out.returncode == 2 and "--since" in out.stderr


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":  # an <a> of the page or of a plot (a run's point); <use href="#..."> is the SVG's own
            self.hrefs += [v for k, v in attrs if k in ("href", "xlink:href") and v]


def test_copy_reports_makes_a_site_that_travels(site: dict, tmp_path: Path) -> None:
    out = servegate("dashboard", "--out", str(tmp_path / "built"), "--copy-reports", db=site["db"])
    assert out.returncode == 0, out.stderr
    moved = Path(shutil.move(tmp_path / "built", tmp_path / "elsewhere"))
    assert len(list((moved / "reports").glob("*.html"))) == len(site["reported"])
    for page in [moved / "index.html", *(moved / "keys").glob("*.html")]:
        parser = _Links()
        parser.feed(page.read_text(encoding="utf-8"))
        assert any("reports/" in h for h in parser.hrefs), page
        for href in parser.hrefs:
            target = (page.parent / unquote(href)).resolve()
            assert target.is_file() and moved in target.parents, f"{page.name}: {href}"


def _internal_links(page, base: Path) -> list[Path]:
    hrefs = page.eval_on_selector_all("a[href]", "els => els.map(e => e.getAttribute('href'))")
    hrefs += page.eval_on_selector_all("svg a", "els => els.map(e => e.getAttribute('xlink:href') "
                                                 "|| e.getAttribute('href')).filter(h => h)")
    targets = []
    for href in hrefs:
        parsed = urlparse(href)
        assert parsed.scheme in ("", "file"), f"external link {href} in {base}"
        targets.append((base / unquote(parsed.path)).resolve())
    return targets


@needs_browser
def test_site_renders_in_chromium_with_change_points_at_the_injected_runs(site: dict) -> None:
    from playwright.sync_api import sync_playwright

    out: Path = site["out"]
    pages = [out / "index.html", *sorted((out / "keys").glob("*.html"))]
    assert len(pages) == 3
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            linked: set[Path] = set()
            marks: dict[str, list[str]] = {}
            for path in pages:
                page.goto(path.as_uri())
                page.wait_for_load_state("load")
                assert page.title().startswith("servegate")
                figures = page.eval_on_selector_all(
                    "figure", "els => els.map(f => { const s = f.querySelector('svg'); const r = s && "
                              "s.getBoundingClientRect(); return r ? [r.width, r.height] : [0, 0]; })")
                assert figures and all(w > 50 and h > 10 for w, h in figures), (path, figures)
                for target in _internal_links(page, path.parent):
                    assert target.is_file(), f"{path.name} links to missing {target}"
                    linked.add(target)
                if path.parent.name == "keys":
                    key = page.get_attribute("h1", "textContent") or page.inner_text("h1")
                    marks[key] = page.eval_on_selector_all(
                        "li.changepoint", "els => els.map(e => e.dataset.metric + '@' + e.dataset.run)")
                    # each trend's points link to the reports that exist (4 metrics x 2 reported runs of the key)
                    assert page.eval_on_selector_all("figure.trend svg a", "els => els.length") == 8
                    svg_marks = page.eval_on_selector_all("figure.trend [id^='changepoint:']", "els => els.length")
                    assert svg_marks == len(marks[key]), (key, svg_marks, marks[key])
                    assert page.locator("[id='distribution-change:0']").count() or key == str(CREEP_KEY)
            assert errors == [], errors
            # each key page links every report that exists (run points and the run table), and only those
            reports = {(site["root"] / "runs" / rid / "report.html").resolve() for rid in site["reported"]}
            assert reports <= linked and all(p.suffix == ".html" for p in linked)

            creep = [m for m in marks[str(CREEP_KEY)] if m.startswith("serving.itl_ms.median@")]
            assert len(creep) == 1 and abs(int(creep[0].rsplit("-", 1)[1]) - CREEP_AT) <= 2, marks
            step = [m for m in marks[str(STEP_KEY)] if m.startswith("serving.ttft_ms.median@")]
            assert len(step) == 1 and abs(int(step[0].rsplit("-", 1)[1]) - STEP_AT) <= 1, marks
            # no change point marked where nothing was injected
            assert not [m for m in marks[str(CREEP_KEY)] if m.startswith("serving.ttft_ms")], marks
            assert not [m for m in marks[str(STEP_KEY)] if m.startswith(("serving.itl_ms", "serving.tpot_ms"))], marks
            # the step key's compared nightlies show the band they were compared with
            page.goto(next(p for p in pages if "vllm" in p.name).as_uri())
            band = page.locator("figure[data-plot='trend:serving.ttft_ms.median'] [id='recorded-band']")
            assert band.count() == 1 and band.bounding_box()["width"] > 20
            # the pinned run is starred on the creeping key's trends
            page.goto(next(p for p in pages if "embedded" in p.name).as_uri())
            assert page.locator(f"[id='pin:{run_id(CREEP_KEY, 3)}']").count() >= 1
            # untrusted text from the database shows as text, not markup
            assert "known-good <b>release</b> build" in page.inner_text("table")
            assert "$ops$" in page.inner_text("table") and "$ops$" in page.locator("figure.trend svg").first.text_content()
            page.goto(next(p for p in pages if "vllm" in p.name).as_uri())
            assert "driver update & new <kernel>" in page.inner_text("body")

            for width, name in ((390, "index-phone.png"), (1400, "index-wide.png")):
                page.set_viewport_size({"width": width, "height": 844})
                page.goto(pages[0].as_uri())
                page.screenshot(path=str(out / name), full_page=True)
                assert (out / name).stat().st_size > 10_000
                overflow = page.evaluate("document.documentElement.scrollWidth")
                assert overflow <= width + 4, f"horizontal overflow at {width}px: {overflow}"
                sparks = page.eval_on_selector_all("figure.spark svg", "els => els.map(s => "
                                                   "s.getBoundingClientRect().width)")
                assert len(sparks) == 8 and all(0 < w <= width for w in sparks), sparks
            assert page.locator(f"section.key .change[data-run='{creep[0].split('@')[1]}']").count() >= 1
        finally:
            browser.close()
