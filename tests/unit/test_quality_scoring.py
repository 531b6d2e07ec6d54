"""Quality stage arithmetic: multiple-choice scoring, agreement, the shipped data, stored references."""

from __future__ import annotations

import json
import math
from collections import Counter

import pandas as pd
import pytest

from servegate.bench.quality import (
    DEFAULT_DATASET,
    DEFAULT_REFERENCE_PROMPTS,
    EncodedItem,
    MCItem,
    QualityConfig,
    compare_outputs,
    encode_item,
    load_mc_items,
    load_reference,
    load_reference_prompts,
    record_reference,
    reference_generate,
    score_items,
    summarise_accuracy,
    summarise_agreement,
)
from servegate.errors import ConfigError, InsufficientDataError
from servegate.tables import AGREEMENT_COLUMNS, ITEM_COLUMNS
from servegate.worker.logprobs import input_token_logprobs
from servegate.models import ensure_model, load_model

pytestmark = pytest.mark.timeout(120)


def _enc(label: int, n_endings: int, index: int) -> EncodedItem:
    item = MCItem(ctx="c", endings=tuple(f"e{j}" for j in range(n_endings)), label=label, index=index)
    return EncodedItem(item=item, ctx_ids=[1], ending_ids=[[2]] * n_endings)


# Hand-computed example. Scores are mean token logprobs (sum / n_tokens):
#   item 0: A -1.0 (sum -2.0)   B -3.0   C -1.3 (sum -3.9)   D -2.1 (sum -4.2)   -> A; label A: right
#   item 1: A -1.5 (sum -1.5)   B -0.4 (sum -1.6, 4 tokens)                      -> B; label B: right
#           (the plain sum would pick A: -1.5 > -1.6 — normalisation decides this one)
#   item 2: A -0.2   B -0.1   C -5.0                                              -> B; label A: wrong
#   item 3: A nan    B -9.0                                                       -> B; label B: right
#           (a NaN score never wins)
# accuracy 3/4 = 0.75, s.e. sqrt(0.75 * 0.25 / 4) = 0.21650635...; plain-sum accuracy 2/4.
HAND_LOGPROBS = [
    [[-1.0, -1.0], [-3.0], [-0.5, -0.5, -2.9], [-4.0, -0.2]],
    [[-1.5], [-0.4, -0.4, -0.4, -0.4]],
    [[-0.2], [-0.1], [-5.0]],
    [[math.nan], [-9.0]],
]
HAND_ITEMS = [_enc(0, 4, 0), _enc(1, 2, 1), _enc(0, 3, 2), _enc(1, 2, 3)]


def test_scoring_against_a_hand_computed_example():
    items = score_items(HAND_ITEMS, HAND_LOGPROBS)
    assert list(items.columns) == ITEM_COLUMNS
    assert items["predicted"].tolist() == [0, 1, 1, 1]
    assert items["correct"].tolist() == [True, True, False, True]
    assert items.loc[0, "scores"] == pytest.approx([-1.0, -3.0, -1.3, -2.1])
    assert items.loc[0, "sum_logprobs"] == pytest.approx([-2.0, -3.0, -3.9, -4.2])
    assert items.loc[1, "n_ending_tokens"] == [1, 4]
    assert items.loc[1, "n_ending_bytes"] == [2, 2]

    summary = summarise_accuracy(items, dataset="hand", protocol="test", duration_s=1.5)
    row = summary.iloc[0]
    assert row["n_items"] == 4 and row["n_correct"] == 3
    assert row["accuracy"] == pytest.approx(0.75)
    assert row["accuracy_stderr"] == pytest.approx(0.21650635094610965)
    assert row["accuracy_unnormalised"] == pytest.approx(0.5)
    assert row["normalisation"] == "token"


def test_ties_go_to_the_first_ending_and_mismatched_answers_are_errors():
    items = score_items([_enc(1, 2, 0)], [[[-1.0], [-0.5, -1.5]]])
    assert items.loc[0, "predicted"] == 0 and not items.loc[0, "correct"]
    from servegate.errors import StageError
    with pytest.raises(StageError):
        score_items([_enc(0, 2, 0)], [[[-1.0]]])
    with pytest.raises(StageError):
        score_items([_enc(0, 2, 0)], [])


def test_no_items_is_an_error_not_zero():
    with pytest.raises(InsufficientDataError, match="not 0"):
        summarise_accuracy(pd.DataFrame(columns=ITEM_COLUMNS))


def test_stderr_is_zero_only_at_the_extremes():
    perfect = score_items([_enc(0, 2, i) for i in range(5)], [[[-0.1], [-2.0]]] * 5)
    row = summarise_accuracy(perfect).iloc[0]
    assert row["accuracy"] == 1.0 and row["accuracy_stderr"] == 0.0


# ----------------------------------------------------------------------------- dataset files


def test_load_mc_items_checks_every_line(tmp_path):
    good = {"ctx": "A", "endings": ["x", "y"], "label": "1"}
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "label": 0, "ind": 4}) + "\n")
    items = load_mc_items(path)
    assert [(it.label, it.index) for it in items] == [(1, 0), (0, 1)]
    for bad, match in [({**good, "label": 2}, "label"), ({**good, "endings": ["x"]}, "endings"),
                       ({**good, "ctx": ""}, "ctx"), ({**good, "label": True}, "label")]:
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ConfigError, match=rf"set.jsonl:2: '{match}'"):
            load_mc_items(path)
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_mc_items(path)
    path.write_text("\n")
    with pytest.raises(InsufficientDataError):
        load_mc_items(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_mc_items(tmp_path / "missing.jsonl")


def test_shipped_set_is_well_formed_balanced_and_short():
    items = load_mc_items(DEFAULT_DATASET)
    assert 200 <= len(items) <= 300
    assert all(len(it.endings) == 4 and len(set(it.endings)) == 4 for it in items)
    assert len({it.ctx for it in items}) == len(items)
    counts = Counter(it.label for it in items)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) - min(counts.values()) <= 0.05 * len(items)
    _, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")  # SmolLM2's tokenizer
    lengths = [len(encode_item(tokenizer, it).ctx_ids) for it in items]
    assert max(lengths) <= 40
    readme = (DEFAULT_DATASET.parent / "README.md").read_text()
    assert "CC0" in readme and DEFAULT_DATASET.name in readme


def test_shipped_reference_prompts_load():
    prompts = load_reference_prompts(DEFAULT_REFERENCE_PROMPTS)
    assert len(prompts) >= 4 and all(text for _, text in prompts)


def test_reference_prompts_file_errors(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}]))
    with pytest.raises(ConfigError, match="unique"):
        load_reference_prompts(path)
    path.write_text(json.dumps([{"prompt": "x"}]))
    with pytest.raises(ConfigError, match="'id'"):
        load_reference_prompts(path)


def test_encode_item_splits_context_and_endings_at_a_space():
    _, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    item = MCItem(ctx="The cat sat on the", endings=("mat.", "moon."), label=0, index=0)
    enc = encode_item(tokenizer, item)
    assert enc.ctx_ids == tokenizer.encode("The cat sat on the")
    assert tokenizer.decode(enc.ctx_ids + enc.ending_ids[0]) == "The cat sat on the mat."
    assert tokenizer.decode(enc.ending_ids[1]) == " moon."
    spaced = encode_item(tokenizer, MCItem(ctx="Say: ", endings=("hi", "yo"), label=0, index=1))
    assert tokenizer.decode(spaced.ending_ids[0]) == "hi"


def test_config_rejects_n_beyond_the_generated_tokens():
    with pytest.raises(ValueError, match="exact_match_tokens"):
        QualityConfig(exact_match_tokens=20, reference_max_new_tokens=10)
    with pytest.raises(ValueError):
        QualityConfig(logprob_tolerance=float("inf"))
    with pytest.raises(ValueError):
        QualityConfig(max_items=0)


# ----------------------------------------------------------------------------- agreement


def test_agreement_full_match_within_tolerance():
    row = compare_outputs([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [5, 6, 7, 8], [-0.1, -0.25, -0.3, -0.4],
                          n_tokens=4, tolerance=0.1, prompt_id="p")
    assert row["exact_match"] and row["first_mismatch_index"] == -1
    assert row["n_logprobs_compared"] == 4
    assert row["max_abs_logprob_diff"] == pytest.approx(0.05)
    assert row["mean_abs_logprob_diff"] == pytest.approx(0.0125)
    assert row["within_tolerance"]


def test_agreement_mismatch_at_token_k_compares_logprobs_only_before_it():
    # Tokens diverge at index 2; the large diff after it is not compared.
    row = compare_outputs([5, 6, 1, 2], [-0.1, -0.2, -9.0, -9.0], [5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4],
                          n_tokens=4, tolerance=0.1)
    assert not row["exact_match"] and row["first_mismatch_index"] == 2
    assert row["n_logprobs_compared"] == 2 and row["max_abs_logprob_diff"] == pytest.approx(0.0)
    assert row["within_tolerance"]
    # Only the first N tokens count: a divergence at index 3 is outside N = 3.
    assert compare_outputs([5, 6, 7, 0], [0, 0, 0, 0], [5, 6, 7, 8], [0, 0, 0, 0], n_tokens=3,
                           tolerance=0.1)["exact_match"]


def test_agreement_tolerance_missing_values_and_short_outputs():
    over = compare_outputs([5, 6], [-0.1, -0.5], [5, 6], [-0.1, -0.2], n_tokens=2, tolerance=0.25)
    assert over["exact_match"] and not over["within_tolerance"]
    assert over["max_abs_logprob_diff"] == pytest.approx(0.3)
    missing = compare_outputs([5, 6], [-0.1, None], [5, 6], [-0.1, -0.2], n_tokens=2, tolerance=0.25)
    assert not missing["within_tolerance"] and math.isinf(missing["max_abs_logprob_diff"])
    nan = compare_outputs([5, 6], [-0.1, math.nan], [5, 6], [-0.1, -0.2], n_tokens=2, tolerance=0.25)
    assert not nan["within_tolerance"]
    short = compare_outputs([5], [-0.1], [5, 6], [-0.1, -0.2], n_tokens=2, tolerance=0.25)
    assert not short["exact_match"] and short["first_mismatch_index"] == 1
    first = compare_outputs([9, 6], [-0.1, -0.2], [5, 6], [-0.1, -0.2], n_tokens=2, tolerance=0.25)
    assert first["first_mismatch_index"] == 0 and not first["within_tolerance"]
    assert math.isnan(first["max_abs_logprob_diff"])


def test_agreement_summary():
    rows = pd.DataFrame([
        compare_outputs([1, 2], [-1.0, -1.0], [1, 2], [-1.1, -1.3], 2, 0.25, prompt_id="a"),  # diffs .1 .3
        compare_outputs([1, 9], [-1.0, -1.0], [1, 2], [-1.2, -1.0], 2, 0.25, prompt_id="b"),  # diff .2, then diverges
    ])
    summary = summarise_agreement(rows, n_tokens=2, tolerance=0.25, reference_source="in-process",
                                  reference_model="m")
    row = summary.iloc[0]
    assert list(summary.columns) == AGREEMENT_COLUMNS
    assert row["n_prompts"] == 2 and row["exact_match_rate"] == 0.5
    assert row["n_tokens_compared"] == 3
    assert row["mean_abs_logprob_diff"] == pytest.approx(0.2)  # (0.1 + 0.3 + 0.2) / 3
    assert row["max_abs_logprob_diff"] == pytest.approx(0.3)
    assert row["within_tolerance_rate"] == 0.5
    with pytest.raises(InsufficientDataError):
        summarise_agreement(rows.iloc[0:0], n_tokens=2, tolerance=0.25, reference_source="x")


# ----------------------------------------------------------------------------- references


def test_reference_generate_is_greedy_with_the_models_own_logprobs():
    model, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    prompt = tokenizer.encode("Once upon a time")
    [(tokens, logprobs)] = reference_generate(model, [prompt], max_new_tokens=5)
    assert len(tokens) == len(logprobs) == 5
    # Teacher-forcing prompt + output through one forward pass gives the same values...
    triples, tops = input_token_logprobs(model, prompt + tokens, start_len=len(prompt) - 1, top_k=1)
    assert [t[1] for t in triples[1:]] == tokens
    assert logprobs == pytest.approx([t[0] for t in triples[1:]], abs=1e-4)
    # ...and every generated token was the most likely one.
    assert [top[0][1] for top in tops[1:]] == tokens


def test_stored_reference_round_trip(tmp_path):
    prompts = [("a", "Hello there"), ("b", "The cat")]
    path = record_reference("tiny-random", prompts, tmp_path / "ref" / "tiny.json", max_new_tokens=4)
    outputs, identity, n = load_reference(path)
    assert n == 4 and identity["name"] == "tiny-random" and identity["dtype"] == "float32"
    assert [(o.prompt_id, o.prompt) for o in outputs] == prompts
    model, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    fresh = reference_generate(model, [tokenizer.encode(text) for _, text in prompts], 4)
    for out, (tokens, logprobs), (_, text) in zip(outputs, fresh, prompts):
        assert out.input_ids == tokenizer.encode(text)
        assert out.output_ids == tokens
        assert out.output_logprobs == pytest.approx(logprobs, abs=1e-6)
        row = compare_outputs(tokens, logprobs, out.output_ids, out.output_logprobs, 4, 1e-3)
        assert row["exact_match"] and row["within_tolerance"]
    assert not list(path.parent.glob(".*tmp*"))  # written atomically, no leftovers


def test_stored_reference_errors(tmp_path):
    with pytest.raises(ConfigError, match="record_reference"):
        load_reference(tmp_path / "none.json")
    path = tmp_path / "bad.json"
    doc = {"schema_version": 1, "model": {}, "max_new_tokens": 2, "created_at": "x",
           "records": [{"id": "a", "prompt": "p", "input_ids": [1], "output_ids": [1, 2], "output_logprobs": [0.0]}]}
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="malformed"):
        load_reference(path)
    doc["records"][0]["output_logprobs"] = [0.0, 0.0]
    doc["schema_version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="schema_version"):
        load_reference(path)


def test_teacher_forced_comparison_accepts_near_tie_flips_and_catches_wrong_tokens():
    # The worker's token 1 differs from the reference's greedy token, but the reference gives it
    # nearly its top log-probability (a bf16 near-tie): compared at every position, gap 0.02.
    near_tie = [(-0.10, -0.10), (-0.72, -0.70), (-0.30, -0.30)]
    row = compare_outputs([5, 9, 7], [-0.12, -0.69, -0.35], [5, 6, 7], [-0.1, -0.7, -0.3], n_tokens=3,
                          tolerance=0.1, teacher_forced=near_tie)
    assert row["logprob_comparison"] == "teacher-forced"
    assert not row["exact_match"] and row["first_mismatch_index"] == 1
    assert row["n_logprobs_compared"] == 3
    assert row["max_abs_logprob_diff"] == pytest.approx(0.05)
    assert row["max_greedy_gap"] == pytest.approx(0.02)
    assert row["within_tolerance"]
    # A token the reference finds very unlikely (a corrupted engine) fails on the greedy gap alone,
    # even when the worker reports a matching log-probability for it.
    wrong = compare_outputs([5, 9], [-0.1, -12.0], [5, 6], [-0.1, -0.7], n_tokens=2, tolerance=0.1,
                            teacher_forced=[(-0.1, -0.1), (-12.0, -0.7)])
    assert wrong["max_abs_logprob_diff"] == pytest.approx(0.0)
    assert wrong["max_greedy_gap"] == pytest.approx(11.3)
    assert not wrong["within_tolerance"]


def test_teacher_forced_reference_scores_the_workers_tokens():
    from servegate.bench.quality import teacher_forced_reference

    model, tokenizer = load_model(ensure_model("tiny-random"), dtype="float32")
    prompt = tokenizer.encode("Once upon a time")
    [(tokens, logprobs)] = reference_generate(model, [prompt], max_new_tokens=4)
    other = [tokens[0], (tokens[1] + 1) % 1000, tokens[2]]
    forced, forced_other, empty = teacher_forced_reference(model, [prompt, prompt, prompt], [tokens, other, []], 4)
    # On its own greedy output the reference's token is its argmax: gap 0, same values.
    assert [lp for lp, _ in forced] == pytest.approx(logprobs, abs=1e-4)
    assert [top for _, top in forced] == pytest.approx(logprobs, abs=1e-4)
    assert len(forced_other) == 3
    assert forced_other[1][0] < forced_other[1][1]
    assert empty == []
    with pytest.raises(ConfigError, match="one output per prompt"):
        teacher_forced_reference(model, [prompt], [tokens, other], 4)


# Batched against one at a time: fp32, so only float rounding may differ (tolerance 1e-4 nats,
# where a broken mask or position shows as whole nats), with prompts of different lengths (left
# padding for generation, right padding for scoring). tiny-random: rotary positions and a causal
# mask like the real model's, at a cost of seconds.


@pytest.fixture(scope="module")
def tiny_f32():
    return load_model(ensure_model("tiny-random"), dtype="float32")


def test_batched_reference_generate_equals_one_prompt_at_a_time(tiny_f32):
    from servegate.bench.quality import reference_threads

    model, tokenizer = tiny_f32
    prompts = [tokenizer.encode(text) for _, text in load_reference_prompts(DEFAULT_REFERENCE_PROMPTS)]
    assert len({len(p) for p in prompts}) > 1  # padding is exercised
    with reference_threads():
        batched = reference_generate(model, prompts, max_new_tokens=8)
        alone = [reference_generate(model, [prompt], max_new_tokens=8)[0] for prompt in prompts]
    for (tokens, logprobs), (alone_tokens, alone_logprobs) in zip(batched, alone):
        assert tokens == alone_tokens
        assert logprobs == pytest.approx(alone_logprobs, abs=1e-4)


def test_batched_in_process_scoring_equals_one_item_at_a_time(tiny_f32):
    from servegate.bench.quality import reference_threads, score_items_in_process

    model, tokenizer = tiny_f32
    encoded = [encode_item(tokenizer, it) for it in load_mc_items(DEFAULT_DATASET)[:12]]
    with reference_threads():
        batched = score_items_in_process(model, encoded, items_per_forward=5)
        alone = score_items_in_process(model, encoded, items_per_forward=1)
    assert [[len(e) for e in item] for item in batched] == [[len(e) for e in enc.ending_ids] for enc in encoded]
    for b_item, a_item in zip(batched, alone):
        for b, a in zip(b_item, a_item):
            assert b == pytest.approx(a, abs=1e-4)
    with pytest.raises(ConfigError, match="items_per_forward"):
        score_items_in_process(model, encoded, items_per_forward=0)


def test_tokenizer_file_gives_the_transformers_tokenizers_ids():
    from transformers import AutoTokenizer

    from servegate.bench.quality import load_tokenizer
    from servegate.bench.quality.data import TokenizerFile

    hf = AutoTokenizer.from_pretrained(str(ensure_model("smollm2-135m")))
    fast = load_tokenizer("smollm2-135m")
    assert isinstance(fast, TokenizerFile)
    items = load_mc_items(DEFAULT_DATASET)
    for item in items:
        assert encode_item(fast, item) == encode_item(hf, item)
    for _, text in load_reference_prompts(DEFAULT_REFERENCE_PROMPTS):
        assert fast.encode(text) == hf.encode(text)
