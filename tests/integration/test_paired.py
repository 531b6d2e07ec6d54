"""The paired stage against real embedded workers (tiny-random model): rounds, restarts, the
sequential stop, the tables, CPU pinning, and that no worker outlives the measurement.

Effects asserted here are large on purpose (a +300 % forward-pass slowdown is a sleep: a busy
machine cannot shrink it); how small a change the paired mode sees is measured by
``servegate calibrate --paired`` and ``benchmarks/``, not asserted in tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from servegate.config import load_config
from servegate.errors import StageError, WorkerDiedError, WorkerLaunchError
from servegate.launch import launch_worker
from servegate.paired.rounds import PairedMeasurement
from servegate.tables import PAIRED_COLUMNS, PAIRED_ROUND_COLUMNS, PAIRED_WORKER_COLUMNS

pytestmark = [pytest.mark.gate, pytest.mark.timeout(900)]

TINY = ["worker.model=tiny-random", "baseline.model=tiny-random", "warmup.num_requests=1"]


def _config(*overrides: str):
    return load_config(profile="smoke-ab", overrides=[*TINY, "paired.output_len=32", "paired.input_len=32",
                                                     *overrides])


def _measure(tmp_path: Path, *overrides: str) -> tuple[PairedMeasurement, list]:
    launched: list = []
    tables: dict = {}
    m = PairedMeasurement(_config(*overrides), tmp_path, register=launched.append, tables=tables)
    m.run()
    return m, launched


@pytest.mark.exclusive
def test_a_slow_candidate_is_a_regression_decided_in_rounds_with_restarts(tmp_path: Path):
    # Interleaved (smoke-ab's duet is in the A/A test below): ABBA order, the sides one after the other.
    m, launched = _measure(tmp_path, 'worker.extra_args=["--fault-decode-slowdown-pct","300"]',
                           "paired.mode=interleaved", "paired.min_rounds=4", "paired.min_units=3",
                           "paired.rounds_per_worker=2",
                           "paired.max_rounds=12", "paired.bound=0.10",
                           "paired.max_measure_s=300", "paired.confirm=true")
    paired = m.tables["paired"].set_index("metric")
    itl = paired.loc["itl_median_ms"]
    assert list(m.tables["paired"].columns) == PAIRED_COLUMNS
    assert itl["decision"] == "regression", m.tables["paired_rounds"].to_string()
    assert itl["ci_low"] > 1.10 and itl["ratio"] > 1.5  # the candidate's ITL is several times the baseline's
    assert itl["rounds"] >= 4 and itl["stopped_because"].startswith("every gated metric decided")
    # paired.confirm: the regression was measured again with fresh workers and fresh prompts, and held.
    first = m.confirm_from
    assert first is not None and first >= 4 and itl["reason"].startswith("confirmed: the first measurement (rounds 1-")
    assert "re-measured to confirm: every gated metric decided" in itl["stopped_because"]
    assert paired.loc["output_throughput", "decision"] == "report_only"  # not gated in smoke-ab
    assert paired.loc["output_throughput", "paired_decision"] in ("regression", "inconclusive")

    rounds = m.tables["paired_rounds"]
    assert list(rounds.columns) == PAIRED_ROUND_COLUMNS
    itl_rounds = rounds[rounds["metric"] == "itl_median_ms"].reset_index(drop=True)
    assert list(itl_rounds["round"]) == list(range(1, first + int(itl["rounds"]) + 1))  # both measurements
    assert list(itl_rounds["order"][:4]) == ["AB", "BA", "AB", "BA"]  # ABBA across rounds
    assert (itl_rounds["b_value"] > itl_rounds["a_value"]).all()
    # Restarted every 2 rounds: instance 0 for rounds 1-2, 1 for 3-4, ...; the re-measurement starts
    # with fresh instances.
    again = (first + 1) // 2
    assert list(itl_rounds["instance"]) == ([i // 2 for i in range(first)]
                                            + [again + i // 2 for i in range(len(itl_rounds) - first)])
    # The interval as it stood after each round, within its measurement: none before min_rounds.
    assert set(itl_rounds["decision"][:3]) == {"inconclusive"} == set(itl_rounds["decision"][first:first + 3])
    assert itl_rounds["decision"].iloc[first - 1] == "regression" == itl_rounds["decision"].iloc[-1]

    workers = m.tables["paired_workers"]
    assert list(workers.columns) == PAIRED_WORKER_COLUMNS
    assert len(workers) == 2 * (int(itl["instances"])) == len(launched)
    candidate = workers[workers["side"] == "candidate"]
    baseline = workers[workers["side"] == "baseline"]
    assert all("--fault-decode-slowdown-pct" in json.loads(a) for a in candidate["extra_args"])
    assert all(json.loads(a) == [] for a in baseline["extra_args"])
    assert (workers["launch_s"] > 0).all()
    # Both workers of an instance pair start up side by side: the candidate's process starts before the
    # baseline's is ready (a restart costs the slower start-up, not the sum of both).
    for a, b in zip(launched[::2], launched[1::2]):
        assert "--fault-decode-slowdown-pct" in b.spec.extra_args and "--fault-decode-slowdown-pct" not in a.spec.extra_args
        assert a.started < b.started < a.started + a.startup_s
    # A pair's wall time (what a restart costs) is less than its two start-ups and warm-ups one after the other.
    pairs = workers.groupby("instance").agg(pair_s=("pair_s", "first"), launch_s=("launch_s", "sum"),
                                            warmup_s=("warmup_s", "sum"), sides=("side", "nunique"))
    assert (pairs["sides"] == 2).all() and (pairs["pair_s"] >= workers.groupby("instance")["launch_s"].max()).all()
    assert (pairs["pair_s"] < pairs["launch_s"] + pairs["warmup_s"]).all(), pairs.to_string()
    # Every instance was stopped: restarts and the end of the measurement leave nothing running.
    assert not any(h.is_alive() for h in launched)
    assert (tmp_path / "baseline-worker.log").is_file() and (tmp_path / "worker.log").is_file()


@pytest.mark.exclusive
def test_a_a_is_never_a_regression_and_the_budget_stops_it(tmp_path: Path):
    # The same worker on both sides, a bound of 10 % and a budget of a few rounds: whatever the
    # machine does meanwhile, ABBA order and pairing keep A/A from looking like a regression.
    m, launched = _measure(tmp_path, "paired.min_rounds=3", "paired.min_units=3", "paired.rounds_per_worker=3",
                           "paired.bound=0.10",
                           "paired.max_measure_s=25")
    itl = m.tables["paired"].set_index("metric").loc["itl_median_ms"]
    assert itl["decision"] in ("no_change", "inconclusive", "improvement"), m.tables["paired_rounds"].to_string()
    assert itl["decision"] != "regression"
    assert m.stopped_because  # decided, or the budget: said either way
    if itl["decision"] == "inconclusive":
        assert "max_measure_s" in m.stopped_because or "max_rounds" in m.stopped_because
    assert 0.5 < itl["ratio"] < 2.0
    assert not any(h.is_alive() for h in launched)


def test_duet_mode_pins_each_worker_to_its_cpus(tmp_path: Path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("duet needs two CPUs")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    seen: dict[int, list[int]] = {}

    def register(handle):
        handle.wait_ready()  # registered as it starts: its threads are there once it is ready
        proc = psutil.Process(handle.pid)
        # every thread of the worker's tree, not only its main thread
        seen[handle.pid] = sorted({c for p in [proc, *proc.children(recursive=True)] for t in p.threads()
                                   for c in os.sched_getaffinity(t.id)})
        launched.append(handle)

    launched: list = []
    tables: dict = {}
    cfg = _config("paired.mode=duet", f"worker.cpus=[{b}]", f"baseline.cpus=[{a}]", "paired.min_rounds=3",
                  "paired.min_units=3", "paired.max_rounds=3", "paired.rounds_per_worker=1")
    PairedMeasurement(cfg, tmp_path, register=register, tables=tables).run()
    workers = tables["paired_workers"].set_index(["side", "instance"])
    assert seen[int(workers.loc[("baseline", 0), "pid"])] == [a]
    assert seen[int(workers.loc[("candidate", 0), "pid"])] == [b]
    # The next instance pair swaps the CPU sets: a slower core is not turned into a ratio.
    assert seen[int(workers.loc[("baseline", 1), "pid"])] == [b]
    assert seen[int(workers.loc[("candidate", 1), "pid"])] == [a]
    assert json.loads(workers.loc[("baseline", 1), "cpus"]) == [b]
    rounds = tables["paired_rounds"]
    assert set(rounds["order"]) == {"A+B"} and rounds["round"].max() == 3
    assert tables["paired"].set_index("metric").loc["itl_median_ms", "stopped_because"].startswith("max_rounds")


def test_a_worker_that_dies_fails_the_measurement_and_leaves_nothing(tmp_path: Path):
    launched: list = []
    tables: dict = {}
    # No restarts: the candidate must live long enough to crash (after its 6th request, in round 2).
    m = PairedMeasurement(_config('worker.extra_args=["--fault-crash-after-requests","6"]', "paired.min_rounds=3",
                                  "paired.rounds_per_worker=1000", "paired.max_measure_s=120"),
                          tmp_path, register=launched.append, tables=tables)
    with pytest.raises(WorkerDiedError) as info:
        m.run()
    # Whichever request first meets the dead worker (the round's liveness check, the next flush or a
    # block's stream), the error names the side that exited, not only a refused connection.
    assert str(info.value).startswith("the candidate worker exited (code "), str(info.value)
    assert not any(h.is_alive() for h in launched)
    # What was measured before the crash is kept (the stage writes it as .partial).
    assert "paired_workers" in tables


def test_a_worker_that_does_not_start_stops_the_other_while_it_starts_up(tmp_path: Path):
    launched: list = []
    tables: dict = {}
    # The candidate's arguments are refused at once (argparse, exit 2) while the baseline is still
    # starting up side by side with it: the error names the candidate, and the baseline is stopped
    # without being waited for.
    m = PairedMeasurement(_config('worker.extra_args=["--no-such-option"]'), tmp_path, register=launched.append,
                          tables=tables)
    with pytest.raises(WorkerLaunchError) as info:
        m.run()
    assert str(info.value).startswith("the candidate worker did not start: "), str(info.value)
    assert "exited during start-up with exit code 2" in str(info.value)
    assert [h.spec.extra_args for h in launched] == [[], ["--no-such-option"]]
    assert not any(h.is_alive() for h in launched)
    baseline = launched[0]
    assert baseline.startup_s is None  # stopped while it started up: never ready, never waited for
    assert "paired_workers" not in tables


@pytest.mark.parametrize("warmup_blocks,where", [(0, "of 4 requests to the candidate worker failed in round 1"),
                                                  (1, "of 4 requests of the candidate worker's warm-up block failed")])
def test_a_round_with_a_failed_request_fails_the_measurement_and_says_why(tmp_path: Path, warmup_blocks: int,
                                                                          where: str):
    launched: list = []
    tables: dict = {}
    # The candidate answers half its requests with HTTP 500, from a seeded draw (SERVEGATE_FAULT_SEED 0:
    # 0.84 for the one warm-up request, then 0.76, 0.42, 0.26, 0.51 for the next four: round 1's, or the
    # warm-up block's before it): that block fails, and the error carries the first failed request's own
    # error, since a client-side check can fail a request that the worker's log shows answered 200 (a
    # token count that contradicts itself).
    m = PairedMeasurement(_config('worker.extra_args=["--fault-error-rate","0.5"]', "paired.max_measure_s=120",
                                  f"paired.warmup_blocks={warmup_blocks}"),
                          tmp_path, register=launched.append, tables=tables)
    with pytest.raises(StageError) as info:
        m.run()
    message = str(info.value)
    assert f"{where} (first: http: HTTP 500: " in message, message
    assert not any(h.is_alive() for h in launched)


def test_each_new_instance_serves_its_warmup_blocks_before_its_first_round(tmp_path: Path):
    # Two warm-up blocks of the measured workload (4 prompts of 32 tokens), unmeasured: the first flush of
    # the instance (before round 1) drops their prompts with the warm-up request's few; the flushes before
    # rounds 2 and 3 drop one block's. Three rounds, one instance pair; interleaved, since a duet's side
    # that ends first serves more prompts until the other ends (what each flush drops would vary).
    m, launched = _measure(tmp_path, "paired.mode=interleaved", "paired.warmup_blocks=2", "paired.min_rounds=3",
                           "paired.min_units=3",
                           "paired.max_rounds=3", "paired.rounds_per_worker=1000", "paired.max_measure_s=300")
    assert len(m.tables["paired_rounds"].query("metric == 'itl_median_ms'")) == 3  # warm-up blocks are not rounds
    for log in ("worker.log", "baseline-worker.log"):
        dropped = [int(line.split("(")[1].split()[0]) for line in (tmp_path / log).read_text().splitlines()
                   if "prefix cache flushed (" in line]
        assert len(dropped) == 3, dropped
        assert 2 * 4 * 32 < dropped[0] < 3 * 4 * 32 and dropped[1:] == [4 * 32, 4 * 32], dropped
    assert not any(h.is_alive() for h in launched)


def test_worker_cpus_pin_the_whole_tree(tmp_path: Path):
    # The embedded worker (pins_after_start) starts up on every CPU and is pinned, every thread of
    # its tree, once it is ready; its thread count is that of worker.cpus, not of its start-up.
    cpu = sorted(os.sched_getaffinity(0))[-1]
    cfg = load_config(profile="smoke", overrides=["worker.model=tiny-random", f"worker.cpus=[{cpu}]"])
    with launch_worker(cfg.worker, tmp_path / "worker.log") as handle:
        assert handle.command[handle.command.index("--num-threads") + 1] == "1"
        proc = psutil.Process(handle.pid)
        threads = [t.id for p in [proc, *proc.children(recursive=True)] for t in p.threads()]
        assert len(threads) > 1
        assert {tuple(os.sched_getaffinity(t)) for t in threads} == {(cpu,)}


def test_a_paired_gate_whose_suites_cannot_judge_the_paired_table_is_refused_before_launch(tmp_path: Path):
    from servegate.errors import ConfigError
    from servegate.runstate import GateRun

    cfg = load_config(profile="smoke", overrides=["baseline.engine=embedded", f"output_dir={tmp_path / 'runs'}"])
    with pytest.raises(ConfigError, match="none for the 'paired' table"):
        GateRun.open(cfg)
    assert not (tmp_path / "runs").exists()  # nothing launched, no run folder
    # The paired profiles' suites do judge it.
    for profile in ("smoke-ab", "cpu-nightly-ab"):
        run = GateRun.open(load_config(profile=profile, overrides=[f"output_dir={tmp_path / profile}"]))
        run.close()
        run.folder.discard()


def test_a_server_that_busy_waits_after_its_last_step_gets_a_pause_before_each_block(tmp_path: Path):
    # vLLM's shm queue reader polls for 1 s after the last step; measured here, the block run second
    # in a round paid for it (TTFT x1.4-2.7) until the pause.
    vllm = load_config(profile="vllm-cpu-ab")
    assert PairedMeasurement(vllm, tmp_path, register=lambda h: None, tables={}).settle_s == 1.5
    assert PairedMeasurement(_config(), tmp_path, register=lambda h: None, tables={}).settle_s == 0.0


REPO = Path(__file__).resolve().parents[2]


def test_a_candidate_tree_on_pythonpath_runs_its_own_code_from_a_checkout(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    # Started from a servegate checkout (its working directory holds servegate/), a candidate whose
    # PYTHONPATH names another tree once ran the checkout's code: a real +9 % kernel read x1.002 (docs/paired.md).
    from servegate.paired.zoo import build_tree
    from servegate.provenance import source_identity

    monkeypatch.chdir(REPO)
    tree = build_tree("linears-unpacked", tmp_path / "zoo")
    m, launched = _measure(tmp_path, f'worker.env={{"PYTHONPATH": "{tree}"}}', "paired.min_rounds=3",
                           "paired.min_units=3", "paired.max_rounds=3", "paired.rounds_per_worker=3")
    workers = m.tables["paired_workers"].set_index("side")
    assert workers.loc["baseline", "build"] == f"servegate source {source_identity()['digest']}"
    assert workers.loc["candidate", "build"] == f"servegate source {source_identity(tree / 'servegate')['digest']}"
    assert source_identity(tree / "servegate")["digest"] != source_identity()["digest"]
    # Each side's own CPU time per output token is measured beside its latency (docs/paired.md).
    cpu = m.tables["paired_rounds"].set_index("metric").loc["cpu_ms_per_token"]
    assert len(cpu) == 3 and (cpu["a_value"] > 0).all() and (cpu["b_value"] > 0).all()
    assert not any(h.is_alive() for h in launched)


def test_two_sides_naming_different_builds_but_running_one_are_refused(tmp_path: Path):
    import shutil

    from servegate.errors import ConfigError
    from servegate.provenance import source_identity

    same = tmp_path / "copy"
    shutil.copytree(source_identity()["path"], same / "servegate", ignore=shutil.ignore_patterns("__pycache__"))
    launched: list = []
    m = PairedMeasurement(_config(f'worker.env={{"PYTHONPATH": "{same}"}}'), tmp_path, register=launched.append,
                          tables={})
    with pytest.raises(ConfigError, match=r"name different builds .* but both workers report the same one: "
                                          r"servegate source [0-9a-f]{16}"):
        m.run()
    assert m.rounds == [] and not any(h.is_alive() for h in launched)
