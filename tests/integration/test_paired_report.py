"""The paired comparison wherever a verdict goes: the HTML report (summary table, per-round ratio
and interval plots, the workers), summary.md, the terminal verdict and `servegate status`.

The tables are built the way the paired stage builds them (servegate/paired/rounds.py: per-round
log ratios B/A, the repeated confidence interval after every round, stop once every gated metric is
decided) from a simulated pair of workers whose candidate decodes 4.3 % slower, and recorded
through the real history store.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_report import _Plots
from test_store import T0, run_inputs

from servegate.cli import main
from servegate.config import PAIRED_METRICS, PairedConfig
from servegate.history import GateKey, Store
from servegate.paired.rounds import decide_metric, stop_reason
from servegate.paired.stats import METHOD
from servegate.plots import paired_interval_plot, paired_ratio_plot
from servegate.render import format_verdict_table
from servegate.report import write_markdown_summary, write_report
from servegate.tables import PAIRED_COLUMNS, PAIRED_ROUND_COLUMNS, PAIRED_WORKER_COLUMNS
from servegate.verdict import Verdict

KEY = GateKey("smoke-ab", "embedded", "cpu-2core", "smollm2-135m")
BOUND = PairedConfig().bound
ROUNDS_PER_WORKER = PairedConfig().rounds_per_worker
BLOCK_S, RESTART_S = 12.0, 20.0
TRUE_RATIO = {"itl_median_ms": 1.043, "tpot_median_ms": 1.04, "ttft_median_ms": 1.0, "e2e_median_ms": 1.03,
              "output_throughput": 0.97, "cpu_ms_per_token": 1.04}
"""The candidate's slowdown per metric (itl is gated, the others are reported)."""
BASE_VALUE = {"itl_median_ms": 80.0, "tpot_median_ms": 82.0, "ttft_median_ms": 600.0, "e2e_median_ms": 6000.0,
              "output_throughput": 40.0, "cpu_ms_per_token": 38.0}
UNITS = {"itl_median_ms": "ms", "tpot_median_ms": "ms", "ttft_median_ms": "ms", "e2e_median_ms": "ms",
         "output_throughput": "tok/s", "cpu_ms_per_token": "ms"}
BASELINE_PYTHON = "/opt/engines/embedded-1.4/bin/python"
NOISE = 0.02
SEED = 1
"""Decided after 20 rounds on 10 instances of each worker, the report-only metrics' intervals saying
regression, no_change and inconclusive (test_the_simulated_tables_are_what_the_stage_would_write)."""


def paired_tables(*, max_measure_s: float = 600.0) -> dict[str, pd.DataFrame]:
    """``paired``, ``paired_rounds`` and ``paired_workers`` as the stage writes them, decided and
    stopped by the stage's own rule (``decide_metric``, ``stop_reason``) under the default paired
    config: the machine drifts by ±10 % between rounds (the ratio cancels it), each block has 2 %
    noise per side, a round takes 12 s and a restart of both workers 20 s."""
    p = PairedConfig(max_measure_s=max_measure_s)
    rngs = {metric: np.random.default_rng([SEED, i]) for i, metric in enumerate(PAIRED_METRICS)}
    values: list[dict[str, tuple[float, float]]] = []  # per round, metric -> (A, B)
    instance_of: list[int] = []  # per round, the workers' instance
    instances, elapsed = 1, 0.0

    def logs(metric: str, upto: int) -> list[float]:
        return [math.log(b / a) for a, b in (v[metric] for v in values[:upto])]

    while True:
        r = len(values)
        restart = r > 0 and r % p.rounds_per_worker == 0
        decided = r >= p.min_rounds and all(
            decide_metric(logs(m, r), PAIRED_METRICS[m][1], p, instance_of[:r])[1] != "inconclusive"
            for m in p.gated)
        stopped_because = stop_reason(p, r, decided=decided, elapsed_s=elapsed,
                                      next_round_s=BLOCK_S + (RESTART_S if restart else 0.0))
        if stopped_because is not None:
            break
        if restart:
            instances += 1
            elapsed += RESTART_S
        drift = 1.0 + 0.1 * math.sin(r)
        values.append({m: (BASE_VALUE[m] * drift * math.exp(rngs[m].normal(0.0, NOISE)),
                           BASE_VALUE[m] * drift * TRUE_RATIO[m] * math.exp(rngs[m].normal(0.0, NOISE)))
                       for m in PAIRED_METRICS})
        instance_of.append(instances - 1)
        elapsed += BLOCK_S
    n = len(values)
    rows = []
    for i, v in enumerate(values):
        for metric, (_, direction) in PAIRED_METRICS.items():
            iv, decision = decide_metric(logs(metric, i + 1), direction, p, instance_of[:i + 1])
            a, b = v[metric]
            rows.append({"round": i + 1, "instance": instance_of[i], "order": "AB" if i % 2 == 0 else "BA",
                         "metric": metric, "a_value": a, "b_value": b, "log_ratio": math.log(b / a),
                         "ratio": iv.ratio, "ci_low": iv.ci_low, "ci_high": iv.ci_high, "decision": decision,
                         "block_s": BLOCK_S})
    summary = []
    for metric, (column, direction) in PAIRED_METRICS.items():
        iv, decision = decide_metric(logs(metric, n), direction, p, instance_of[:n])
        summary.append({
            "metric": metric, "column": column, "unit": UNITS[metric], "direction": direction,
            "gated": metric in p.gated, "rounds": n, "baseline_median": float(np.median([v[metric][0] for v in values])),
            "candidate_median": float(np.median([v[metric][1] for v in values])), "ratio": iv.ratio,
            "ci_low": iv.ci_low, "ci_high": iv.ci_high, "confidence": p.confidence, "bound": p.bound,
            "sd_log": iv.sd_log, "decision": decision if metric in p.gated else "report_only",
            "paired_decision": decision,
            "reason": None if decision != "inconclusive" else f"the interval straddles the bound after {n} rounds",
            "stopped_because": stopped_because, "measure_s": elapsed, "instances": instances, "mode": p.mode,
            "order": p.order, "rounds_per_worker": p.rounds_per_worker, "method": METHOD})
    workers = []
    for instance in range(instances):
        workers.append({"side": "baseline", "instance": instance, "engine": "embedded", "model": "smollm2-135m",
                        "python": BASELINE_PYTHON, "extra_args": json.dumps(["--max-running-requests", "32"]),
                        "cpus": json.dumps([0]), "pid": 27005 + 10 * instance, "launch_s": 7.151 + instance,
                        "warmup_s": 2.38})
        workers.append({"side": "candidate", "instance": instance, "engine": "embedded", "model": "smollm2-135m",
                        "python": None, "extra_args": json.dumps([]), "cpus": json.dumps([1]),
                        "pid": 27237 + 10 * instance, "launch_s": 13.101 + instance, "warmup_s": 2.331})
    return {"paired": pd.DataFrame(summary, columns=PAIRED_COLUMNS),
            "paired_rounds": pd.DataFrame(rows, columns=PAIRED_ROUND_COLUMNS),
            "paired_workers": pd.DataFrame(workers, columns=PAIRED_WORKER_COLUMNS)}


PAIRED_BREACH = {"table": "paired", "expectation": "expect_column_values_to_not_be_in_set", "column": "decision",
                 "observed": {"unexpected_count": 1, "element_count": 5, "unexpected_values": ["regression"]},
                 "allowed": "not in [regression]", "source": "paired bound (servegate/paired/stats.py)"}


@pytest.fixture()
def recorded(tmp_path: Path) -> tuple[Store, str, Path, dict[str, pd.DataFrame]]:
    """A smoke-ab run that found the regression, recorded as the flow records it."""
    tables = paired_tables()
    inputs = run_inputs("ab-1", started_at=T0 + timedelta(days=1), key=KEY, tables=tables)
    inputs["outcomes"] = [{"table": "paired", "expectation_type": "expect_column_values_to_not_be_in_set",
                           "column": "decision", "kwargs": {"value_set": ["regression"]}, "success": False,
                           "table_produced": True, "reason": None, "observed": PAIRED_BREACH["observed"],
                           "allowed": "not in [regression]", "meta": {"source": PAIRED_BREACH["source"]}}]
    inputs["verdict"] = {"status": "fail", "reason": "1 expectation(s) breached", "breaches": [PAIRED_BREACH],
                         "infra_errors": []}
    run_dir = tmp_path / "runs" / "ab-1"
    run_dir.mkdir(parents=True)
    store = Store(str(tmp_path / "history.db"))
    store.record_run(**inputs, run_dir=run_dir)
    yield store, "ab-1", run_dir, tables
    store.close()


def _gated(tables: dict[str, pd.DataFrame]) -> pd.Series:
    paired = tables["paired"]
    return paired[paired["gated"]].iloc[0]


def _num(value: float) -> str:
    return f"{value:.4f}"  # ratios near 1 with four decimals: 1.0154 clears a 1.5 % bound, 1.015 would not say


def _expected_line(row: pd.Series, *, why: bool = True) -> str:
    line = (f"itl_median_ms: ×{_num(row.ratio)} [{_num(row.ci_low)}, {_num(row.ci_high)}] vs bound 1.5% -> "
            f"regression after {row.rounds} rounds")
    return line + " (every gated metric decided)" if why else line


def test_the_simulated_tables_are_what_the_stage_would_write() -> None:
    tables = paired_tables()
    row = _gated(tables)
    assert row.decision == "regression" and row.rounds == 20 and row.instances == 10
    assert row.ci_low > 1 + BOUND and row.ratio == pytest.approx(1.043, abs=0.01)
    assert set(tables["paired"].loc[~tables["paired"]["gated"], "decision"]) == {"report_only"}
    assert list(tables["paired"]["paired_decision"]) == ["regression", "regression", "no_change", "regression",
                                                         "inconclusive", "inconclusive"]
    assert tables["paired_rounds"]["round"].max() == row.rounds
    assert set(tables["paired_workers"]["instance"]) == set(range(row.instances))


class _Cells(HTMLParser):
    """The cells of the table with class ``css``, row by row."""

    def __init__(self, css: str) -> None:
        super().__init__()
        self.css, self.rows, self._in, self._cell = css, [], False, None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self._in = dict(attrs).get("class") == self.css
        elif self._in and tag == "tr":
            self.rows.append([])
        elif self._in and tag in ("td", "th"):
            self._cell = ""

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in = False
        elif self._in and tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append(self._cell)
            self._cell = None


def _table(text: str, css: str) -> list[dict[str, str]]:
    cells = _Cells(css)
    cells.feed(text)
    head, *body = cells.rows
    return [dict(zip(head, row)) for row in body]


def _figure(text: str, name: str) -> str:
    start = text.index(f'data-plot="{name}"')
    return text[start:text.index("</figure>", start)]


def test_report_has_the_paired_section_with_plots_and_workers(recorded) -> None:
    store, run_id, run_dir, tables = recorded
    text = write_report(store, run_id).read_text(encoding="utf-8")
    assert '<h2 id="paired">Paired comparison (candidate / baseline)</h2>' in text
    # A paired-only run has no history comparison: no empty section, no "never calibrated" note.
    assert "Comparison with the baseline" not in text and "never calibrated" not in text
    row = _gated(tables)
    n = int(row.rounds)
    assert (f"side by side in {n} round(s), interleaved, abba order, restarted every {ROUNDS_PER_WORKER} rounds "
            f"({row.instances} instance(s) of each)") in text
    assert f"Stopped: every gated metric decided after {n} rounds." in text

    shown = {r["metric"]: r for r in _table(text, "paired")}
    assert list(shown) == list(PAIRED_METRICS)
    itl = shown["itl_median_ms"]
    assert itl["ratio"] == _num(row.ratio) and itl["interval"] == f"[{_num(row.ci_low)}, {_num(row.ci_high)}]"
    assert itl["bound"] == "1.5%" and itl["decision"] == "regression" and itl["rounds"] == str(n)
    assert itl["baseline (median)"] == f"{row.baseline_median:.4g}"
    assert '<td class="bad">regression</td>' in text  # coloured like a regressing comparison row
    for metric in ("tpot_median_ms", "ttft_median_ms", "e2e_median_ms", "output_throughput"):
        interval_says = tables["paired"].set_index("metric").loc[metric, "paired_decision"]
        assert shown[metric]["decision"] == f"report only ({interval_says})", shown[metric]
    assert text.count('class="bad"') == 1  # only the gated regression is marked, not a report-only one

    plots = _Plots()
    plots.feed(text)
    assert plots.scripts == 0 and plots.external == []
    paired_plots = sorted(name for name in plots.plots if name.startswith("paired_"))
    assert paired_plots == ["paired_interval:itl_median_ms", "paired_ratio:itl_median_ms"]  # gated metrics only
    for name in paired_plots:
        assert plots.plots[name]["svg"] and plots.plots[name]["paths"] > 0 and not plots.plots[name]["empty"]
    per_round = _figure(text, "paired_ratio:itl_median_ms")
    points = per_round.index('<g id="paired_ratio:itl_median_ms:rounds">')
    points = per_round[points:per_round.index('<g id="', points + 1)]
    assert points.count("<use ") == n  # one marker per round
    assert "regression bound ×1.0150" in per_round and "improvement bound ×0.9850" in per_round
    assert f"over all rounds ×{_num(row.ratio)}" in per_round
    if row.instances > 1:
        assert "workers restarted" in per_round
    narrowing = _figure(text, "paired_interval:itl_median_ms")
    assert "95% repeated confidence interval" in narrowing and "regression bound ×1.0150" in narrowing
    first_decided = tables["paired_rounds"].query("metric == 'itl_median_ms' and decision == 'regression'")
    assert f"decided: regression (round {int(first_decided['round'].iloc[0])})" in narrowing

    workers = _table(text, "paired-workers")
    assert len(workers) == 2 * row.instances
    baseline, candidate = workers[0], workers[1]
    assert baseline["side"] == "baseline" and baseline["python"] == BASELINE_PYTHON
    assert baseline["extra args"] == '["--max-running-requests", "32"]' and baseline["CPUs"] == "[0]"
    assert baseline["launch (s)"] == "7.15" and baseline["warm-up (s)"] == "2.38"
    assert candidate["side"] == "candidate" and candidate["python"] == "default" and candidate["extra args"] == "[]"
    assert candidate["engine"] == "embedded" and candidate["model"] == "smollm2-135m"
    assert candidate["launch (s)"] == "13.1" and candidate["warm-up (s)"] == "2.33"


def test_a_report_without_a_paired_table_has_no_paired_section(tmp_path: Path) -> None:
    with Store(str(tmp_path / "h.db")) as store:
        store.record_run(**run_inputs("plain", started_at=T0))
        text = write_report(store, "plain", tmp_path / "r.html").read_text()
    assert 'id="paired"' not in text and 'data-plot="paired_' not in text


def test_plots_of_a_stage_stopped_before_an_interval_say_why() -> None:
    tables = paired_tables(max_measure_s=20.0)  # the budget ends the stage after its first round
    row = tables["paired"].iloc[0].to_dict()
    assert row["rounds"] == 1 and math.isinf(row["ci_high"])
    assert 'data-empty="the interval was never bounded (fewer than 2 rounds)"' in paired_interval_plot(
        row, tables["paired_rounds"])
    assert "<svg" in paired_ratio_plot(row, tables["paired_rounds"])  # one round is still one ratio
    assert 'data-empty="no round of the paired stage measured this metric"' in paired_ratio_plot(row, None)


def test_summary_md_has_one_line_per_gated_paired_metric(recorded, tmp_path: Path) -> None:
    store, run_id, _, tables = recorded
    rec = store.get_run(run_id)
    text = write_markdown_summary(rec.verdict, store.outcomes(run_id), None, paired=store.table(run_id, "paired"),
                                  run_id=run_id, key=str(rec.key), path=tmp_path / "summary.md")
    assert (tmp_path / "summary.md").read_text() == text
    section = text.split("### Paired comparison (candidate / baseline)\n", 1)[1].splitlines()
    escaped = _expected_line(_gated(tables)).replace("[", "\\[").replace("]", "\\]")  # no link syntax
    assert section == [f"- **{escaped}**"]  # the regression in bold; report-only metrics not listed
    markdown_it = pytest.importorskip("markdown_it")
    rendered = markdown_it.MarkdownIt("commonmark").render(text)
    assert f"<li><strong>{_expected_line(_gated(tables)).replace('>', '&gt;')}</strong></li>" in rendered
    no_paired = write_markdown_summary(rec.verdict, store.outcomes(run_id), None, run_id=run_id)
    assert "Paired" not in no_paired


def test_terminal_verdict_lists_the_gated_paired_metrics(recorded) -> None:
    store, run_id, _, tables = recorded
    verdict = Verdict.model_validate({**store.get_run(run_id).verdict,
                                      "summary": {"expectations": 1, "passed": 0, "failed": 1, "not_evaluated": 0,
                                                  "not_produced": 0}})
    text = format_verdict_table(verdict, store.table(run_id, "paired").to_dict("records"))
    lines = text.splitlines()
    at = lines.index("Paired comparison (candidate / baseline):")
    assert lines[at + 1:] == [f"  - {_expected_line(_gated(tables))}"]
    assert "Paired" not in format_verdict_table(verdict)


def test_status_shows_the_gated_paired_ratio_and_decision(recorded, capsys) -> None:
    _, _, run_dir, tables = recorded
    db = run_dir.parents[1] / "history.db"
    capsys.readouterr()
    assert main(["status", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(str(KEY)) and " FAIL " in lines[0] and "vs a baseline worker (paired)" in lines[0]
    row = _gated(tables)
    assert lines[1].strip() == f"- paired {_expected_line(row, why=False)}"
    assert not any("paired.decision" in line for line in lines)  # the breach is that line, not repeated
    assert main(["status", "--json", "--db", str(db)]) == 0
    shown = json.loads(capsys.readouterr().out)[0]
    assert shown["paired"] == [{"metric": "itl_median_ms", "ratio": pytest.approx(row.ratio),
                                "ci_low": pytest.approx(row.ci_low), "ci_high": pytest.approx(row.ci_high),
                                "bound": BOUND, "decision": "regression", "rounds": int(row.rounds),
                                "stopped_because": f"every gated metric decided after {row.rounds} rounds"}]
    assert shown["breaches"] == [] and shown["run_id"] == "ab-1"


def test_an_interval_not_yet_bounded_reads_as_such_in_every_output(tmp_path: Path) -> None:
    """After one round the interval is [0, inf] (no spread yet); the store keeps inf as a missing value."""
    tables = paired_tables(max_measure_s=20.0)  # the budget ends the stage after its first round
    with Store(str(tmp_path / "h.db")) as store:
        store.record_run(**run_inputs("one-round", started_at=T0, key=KEY, tables=tables, status="inconclusive"))
        paired = store.table("one-round", "paired")
        html_text = write_report(store, "one-round", tmp_path / "r.html").read_text()
    gated = paired[paired["gated"]].iloc[0]
    assert gated.ci_low == 0 and not math.isfinite(gated.ci_high)
    expected = (f"itl_median_ms: ×{_num(gated.ratio)} [unbounded] vs bound 1.5% -> inconclusive after 1 round "
                f"(measurement budget max_measure_s = 20 s: another round would end past it)")
    verdict = Verdict.model_validate({"status": "inconclusive", "reason": "r", "summary": {
        "expectations": 0, "passed": 0, "failed": 0, "not_evaluated": 0, "not_produced": 0}})
    assert format_verdict_table(verdict, paired.to_dict("records")).splitlines()[-1] == f"  - {expected}"
    assert _table(html_text, "paired")[0]["interval"] == "[unbounded]"
