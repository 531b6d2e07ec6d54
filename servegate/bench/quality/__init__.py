"""Quality stage: a multiple-choice accuracy floor and reference agreement.

Speed regressions are half of what a gate catches; the other half is an engine that answers
worse (a broken kernel, a wrong cache reuse, a sampling bug). Two measurements catch it:

1. **Multiple-choice accuracy**, HellaSwag-style: each ending of an item scored by its
   token-length-normalised log-likelihood as the server computes it, the argmax compared with
   the label; accuracy with its standard error ``sqrt(p (1 - p) / n)``.
2. **Reference agreement**, like SGLang's ``bench_one_batch`` correctness mode but checked
   automatically: for fixed prompts the worker's greedy output ids and per-token output
   log-probabilities are compared with a reference — an in-process fp32 run of the same model
   with transformers, or a stored file recorded from a trusted run (``record_reference``).
   ``exact_match``: the first N tokens are identical. With the in-process reference,
   log-probabilities are compared *teacher-forced* — the reference model scores the worker's
   own output — at every one of the first N positions, together with the greedy gap: a bf16
   engine flipping a near-tie stays within tolerance, a broken one does not. With a stored
   reference, only the agreeing prefix can be compared.

::

    data       the multiple-choice set and the reference prompts, loaded, checked, tokenized
    scoring    length-normalised log-prob scoring, its standard error, agreement rows
    reference  the in-process fp32 reference, stored trusted runs, in-process accuracy
    stage      run_quality: the requests, through the engine's WireProtocol and servegate.http
"""

from servegate.bench.quality.data import (
    DATA_DIR,
    DEFAULT_DATASET,
    DEFAULT_REFERENCE_PROMPTS,
    EncodedItem,
    MCItem,
    encode_item,
    load_mc_items,
    load_tokenizer,
    load_reference_prompts,
)
from servegate.bench.quality.reference import (
    ITEMS_PER_FORWARD,
    REFERENCE_SCHEMA_VERSION,
    REFERENCE_THREADS,
    ReferenceOutput,
    load_reference,
    record_reference,
    reference_generate,
    reference_threads,
    run_accuracy_in_process,
    score_items_in_process,
    teacher_forced_reference,
)
from servegate.bench.quality.scoring import compare_outputs, score_items, summarise_accuracy, summarise_agreement
from servegate.bench.quality.stage import QualityResult, run_quality, server_ending_logprobs, server_greedy_outputs
from servegate.config import QualityConfig

__all__ = [
    "DATA_DIR",
    "DEFAULT_DATASET",
    "DEFAULT_REFERENCE_PROMPTS",
    "REFERENCE_SCHEMA_VERSION",
    "REFERENCE_THREADS",
    "ITEMS_PER_FORWARD",
    "QualityConfig",
    "QualityResult",
    "MCItem",
    "EncodedItem",
    "ReferenceOutput",
    "load_mc_items",
    "load_tokenizer",
    "load_reference_prompts",
    "encode_item",
    "score_items",
    "summarise_accuracy",
    "compare_outputs",
    "teacher_forced_reference",
    "summarise_agreement",
    "reference_generate",
    "reference_threads",
    "record_reference",
    "load_reference",
    "score_items_in_process",
    "run_accuracy_in_process",
    "server_ending_logprobs",
    "server_greedy_outputs",
    "run_quality",
]
