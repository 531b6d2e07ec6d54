"""The offline one-batch benchmark on the real tiny-random model: rows, statuses, arithmetic."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest
import torch

from servegate.bench.offline import _random_input_ids, _run_case, run_offline_one_batch
from servegate.config import OneBatchConfig
from servegate.tables import OFFLINE_ONE_BATCH_COLUMNS
from servegate.models import ensure_model, load_model

pytestmark = pytest.mark.timeout(300)

CONTRACT_COLUMNS = {
    "run_name", "mode", "batch_size", "input_len", "output_len", "status", "skip_reason", "latency",
    "last_ttft", "ttft_ms", "input_throughput", "output_throughput", "overall_throughput",
    "prefill_latency", "median_decode_latency", "error",
}
SGLANG_BENCH_ONE_BATCH_FIELDS = {
    "run_name", "batch_size", "input_len", "output_len", "prefill_latency", "prefill_throughput",
    "median_decode_latency", "median_decode_throughput", "overall_throughput",
}

GRID = OneBatchConfig(mode="offline", batch_sizes=[1, 2], input_lens=[8, 16], output_lens=[1, 4], seed=7)


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return run_offline_one_batch("tiny-random", GRID, dtype="float32")


def test_one_row_per_case_in_grid_order(table):
    assert list(table.columns) == OFFLINE_ONE_BATCH_COLUMNS
    assert CONTRACT_COLUMNS <= set(table.columns)
    assert SGLANG_BENCH_ONE_BATCH_FIELDS <= set(table.columns)
    cases = list(itertools.product(GRID.batch_sizes, GRID.input_lens, GRID.output_lens))
    assert list(table[["batch_size", "input_len", "output_len"]].itertuples(index=False, name=None)) == cases
    assert (table["mode"] == "offline").all()
    assert (table["run_name"] == "tiny-random").all()
    assert (table["status"] == "measured").all()
    assert table["skip_reason"].isna().all() and table["error"].isna().all()


def test_latencies_positive_and_consistent(table):
    for row in table.itertuples(index=False):
        bs, il, ol = row.batch_size, row.input_len, row.output_len
        assert row.prefill_latency > 0 and row.latency >= row.prefill_latency
        assert row.last_ttft == row.prefill_latency
        assert row.ttft_ms == pytest.approx(row.prefill_latency * 1000)
        assert row.prefill_throughput == pytest.approx(bs * il / row.prefill_latency)
        assert row.input_throughput == pytest.approx(bs * il / row.last_ttft)
        assert row.overall_throughput == pytest.approx(bs * (il + ol) / row.latency)
        if ol == 1:
            # the prefill makes the only token: no decode step, nothing to take a median of
            assert row.latency == row.prefill_latency
            assert math.isnan(row.median_decode_latency) and math.isnan(row.median_decode_throughput)
            assert math.isnan(row.output_throughput)
            continue
        decode_time = row.latency - row.prefill_latency
        assert row.median_decode_latency > 0 and decode_time > 0
        # latency = prefill + sum of the ol-1 steps, and at least half the steps take >= the median
        assert decode_time >= row.median_decode_latency * math.ceil((ol - 1) / 2) * (1 - 1e-9)
        assert decode_time <= row.latency
        assert row.median_decode_throughput == pytest.approx(bs / row.median_decode_latency)
        assert row.output_throughput == pytest.approx(bs * ol / decode_time)


def test_case_runs_one_prefill_then_one_token_per_decode_step():
    model, _tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    shapes: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        prefill_latency, decode_latencies = _run_case(model, _random_input_ids(1, 3, 10, 49152), output_len=5)
    finally:
        hook.remove()
    assert shapes == [(3, 10)] + [(3, 1)] * 4
    assert prefill_latency > 0 and len(decode_latencies) == 4 and min(decode_latencies) > 0


def test_random_inputs_are_seeded_per_case():
    first = _random_input_ids(1, 2, 16, 49152)
    assert first.shape == (2, 16) and int(first.max()) < 10000 and int(first.min()) >= 0
    assert torch.equal(first, _random_input_ids(1, 2, 16, 49152))
    assert not torch.equal(first, _random_input_ids(2, 2, 16, 49152))
    assert int(_random_input_ids(1, 4, 64, 100).max()) < 100  # a small vocabulary bounds the ids


def test_cases_over_token_capacity_are_skipped_with_a_reason():
    table = run_offline_one_batch("tiny-random", GRID, max_total_tokens=30, dtype="float32")
    needed = table["batch_size"] * (table["input_len"] + table["output_len"])
    skipped = table[needed > 30]
    measured = table[needed <= 30]
    assert len(skipped) == 2 and len(measured) == 6
    assert (skipped["status"] == "skipped").all()
    assert skipped["skip_reason"].str.contains("exceeds the KV token capacity max_total_tokens=30").all()
    assert skipped["skip_reason"].str.contains("skip_token_capacity_check").all()
    assert skipped[["latency", "prefill_latency", "ttft_ms", "overall_throughput"]].isna().all().all()
    assert (measured["status"] == "measured").all() and (measured["latency"] > 0).all()


def test_capacity_check_opt_out_runs_every_case():
    cfg = GRID.model_copy(update={"skip_token_capacity_check": True, "batch_sizes": [2], "input_lens": [16]})
    table = run_offline_one_batch("tiny-random", cfg, max_total_tokens=30, dtype="float32")
    assert list(table["status"]) == ["measured", "measured"]
    assert (table["latency"] > 0).all() and table["skip_reason"].isna().all()


def test_default_bfloat16_runs():
    cfg = OneBatchConfig(mode="offline", batch_sizes=[2], input_lens=[8], output_lens=[3])
    table = run_offline_one_batch("tiny-random", cfg)
    assert list(table["status"]) == ["measured"] and table["latency"].iloc[0] > 0


def test_repeats_give_one_row_per_repeat_with_its_own_prompts():
    cfg = GRID.model_copy(update={"batch_sizes": [1, 4], "input_lens": [8], "output_lens": [4], "repeats": 3})
    table = run_offline_one_batch("tiny-random", cfg, max_total_tokens=30, dtype="float32")
    measured = table[table["status"] == "measured"]
    assert list(measured["repeat"]) == [0, 1, 2] and (measured["batch_size"] == 1).all()
    assert (measured["latency"] > 0).all()
    assert table.loc[table["status"] == "skipped", "repeat"].tolist() == [0]  # 4 * 12 > 30: one row
    assert torch.equal(_random_input_ids(7, 1, 8, 49152, 0), _random_input_ids(7, 1, 8, 49152))
    assert not torch.equal(_random_input_ids(7, 1, 8, 49152, 1), _random_input_ids(7, 1, 8, 49152, 2))
