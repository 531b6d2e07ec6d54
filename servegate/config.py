"""The gate's configuration: one typed model, loaded from TOML or YAML, with CLI overrides.

Invalid values are rejected when the config loads, with the field, the value and what
is allowed (``ConfigError``); every timeout, interval and duration is a ``Seconds``,
``Milliseconds`` or ``Days`` field (finite, > 0). Shipped profiles live in
``servegate/profiles/<name>.toml`` and are chosen by name only.

Secrets — ``worker.api_key`` (a ``SecretStr``), secret-named ``worker.env`` values, passwords in
``worker.url`` and ``store.url`` — are redacted in every JSON dump (``model_dump(mode="json")``),
which is how the config reaches config.json, the history database and Prefect's flow-run
parameters. Code that sends the key calls ``WorkerSpec.api_key_value()``; ``worker.api_key_env``
names an environment variable that holds it, so that no file has to. Memory budgets (one model
per engine, the named memory profiles) live in ``servegate.budgets``.

Why one module of ~650 lines: it is one schema (the sections of ``GateConfig`` and the
validators that tie them together: secrets, durations, per-engine budgets), read top to bottom
by whoever writes a profile; split by section, every validator would import every other section.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, FieldSerializationInfo,
                      SecretStr, ValidationError, ValidationInfo, field_serializer, field_validator, model_validator)

from servegate.budgets import BUDGET_MODELS, MEMORY_PROFILES, EngineBudget, MemoryBudget, budget_fields_for
from servegate.errors import ConfigError

__all__ = [
    "EngineName",
    "WorkerSpec",
    "WarmupConfig",
    "FlushConfig",
    "OneBatchConfig",
    "ServingConfig",
    "OccupancyConfig",
    "QualityConfig",
    "QUALITY_DATA_DIR",
    "ValidateConfig",
    "CompareConfig",
    "StoreConfig",
    "ReportConfig",
    "HostConfig",
    "CostConfig",
    "PairedConfig",
    "PAIRED_METRICS",
    "GateConfig",
    "PROFILES_DIR",
    "available_profiles",
    "load_config",
    "apply_overrides",
    "Seconds",
    "Milliseconds",
    "Days",
    "REDACTED",
    "is_secret_env_name",
    "redact_url",
]

PROFILES_DIR = Path(__file__).parent / "profiles"
QUALITY_DATA_DIR = Path(__file__).resolve().parent.parent / "expectations" / "data"
"""The shipped quality data (a checkout or editable install; override the paths in config otherwise)."""

EngineName = Literal["embedded", "sglang", "vllm", "external", "transformers"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---- durations ------------------------------------------------------------------------------
# Every timeout, interval and duration of the config is one of these types, so that all of them
# are checked the same way at load time: a NaN timeout never fires, a negative one fails every
# request at once, an infinite one hangs the gate (the error names the field and the value).
def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    return value


def _duration_check(unit: str) -> Any:
    def check(value: float) -> float:
        if math.isnan(value) or math.isinf(value) or value <= 0:
            raise ValueError(f"must be a finite number > 0 ({unit}), got {value!r}")
        return value
    return check


Seconds = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_duration_check("seconds"))]
"""A timeout, interval or duration in seconds: finite and > 0."""
Milliseconds = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_duration_check("milliseconds"))]
"""A latency bound in milliseconds: finite and > 0."""
Days = Annotated[float, BeforeValidator(_not_bool), AfterValidator(_duration_check("days"))]
"""A look-back window in days: finite and > 0."""


# ---- secrets ------------------------------------------------------------------------------
REDACTED = "<redacted>"
"""What a secret looks like in every JSON dump of the config: config.json, the history database,
Prefect's flow-run parameters."""

_REDACTED_PLACEHOLDERS = (REDACTED, "**********")  # ours, and SecretStr's own str()
_SECRET_ENV_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_URL_PASSWORD_RE = re.compile(r"^(?P<user>[A-Za-z][\w+.-]*://[^:/@]*:)[^@]*@")
_PLAIN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_secret_env_name(name: str) -> bool:
    """True for environment variable names that hold secrets (``HF_TOKEN``, ``*_API_KEY``, ...)."""
    return bool(_SECRET_ENV_RE.search(name))


def redact_url(url: str | None) -> str | None:
    """``url`` with its password shown as ``***`` (for messages and snapshots); unchanged when it
    carries none (SQLite paths, URLs without credentials).

    Database URLs are rendered by SQLAlchemy (``render_as_string(hide_password=True)``), which
    parses a password that holds ``/`` or ``:``; HTTP URLs keep their exact spelling otherwise.
    """
    if not url or not _URL_PASSWORD_RE.match(url):
        return url
    scheme = url.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        from sqlalchemy.engine import make_url  # only here: the CLI parser must not import SQLAlchemy
        from sqlalchemy.exc import ArgumentError

        try:
            return make_url(url).render_as_string(hide_password=True)
        except (ArgumentError, ValueError):
            pass
    return _URL_PASSWORD_RE.sub(r"\g<user>***@", url, count=1)


def _check_cpus(v: list[int] | None) -> list[int] | None:
    if v is None:
        return v
    have = sorted(os.sched_getaffinity(0))
    if not v or any(c not in have for c in v) or len(set(v)) != len(v):
        raise ValueError(f"must be a non-empty list of distinct CPUs this process may use ({have}), got {v!r}")
    return v


class WorkerSpec(_Model):
    engine: EngineName = Field("embedded", description="which engine to launch (or 'external' to attach)")
    model: str = Field("smollm2-135m", description="model path or name the engine understands")
    host: str = Field("127.0.0.1", description="bind / connect host")
    port: int = Field(0, ge=0, le=65535, description="port; 0 picks a free one")
    url: str | None = Field(None, description="base URL of an already running server (engine=external)")
    memory_profile: str = Field("cpu-small", description=f"one of {sorted(MEMORY_PROFILES)}")
    memory: EngineBudget | None = Field(None, description="explicit budget fields of the worker's engine; "
                                                          "override memory_profile's")
    extra_args: list[str] = Field(default_factory=list, description="extra launch arguments, appended verbatim")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the worker process")
    python: str | None = Field(None, description="python executable for engines in their own virtualenv")
    ready_timeout_s: Seconds = Field(300.0, description="seconds to wait for readiness")
    enable_metrics: bool = Field(True, description="ask the engine to expose /metrics")
    speculative_num_draft_tokens: int | None = Field(None, gt=0, description="NGRAM speculative decoding")
    api_key: SecretStr | None = Field(None, description=f"Bearer token for the server; {REDACTED} in every snapshot "
                                                        f"(prefer api_key_env: then no file holds it)")
    api_key_env: str | None = Field(None, description="name of the environment variable that holds the Bearer "
                                                      "token, read when the worker is launched")
    cpus: list[int] | None = Field(None, description=(
        "pin the worker's process tree to these CPUs (sched_setaffinity before exec, or on every thread once it "
        "is ready for an engine that allows it: the embedded worker, whose start-up then uses every CPU; "
        "None: any CPU)"))

    @field_validator("cpus")
    @classmethod
    def _cpus_exist(cls, v: list[int] | None) -> list[int] | None:
        return _check_cpus(v)

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not _ENV_NAME_RE.match(v):
            raise ValueError(f"must be an environment variable name (letters, digits, _), got {v!r}; "
                             f"it names the variable that holds the key, not the key itself")
        return v

    @field_serializer("api_key", when_used="json")
    def _hide_api_key(self, value: SecretStr | None) -> str | None:
        return None if value is None else REDACTED

    @field_serializer("env", when_used="json")
    def _hide_secret_env(self, value: dict[str, str]) -> dict[str, str]:
        return {k: (REDACTED if is_secret_env_name(k) else v) for k, v in value.items()}

    @field_serializer("url", when_used="json")
    def _hide_url_password(self, value: str | None) -> str | None:
        return redact_url(value)

    def api_key_value(self) -> str | None:
        """The Bearer token in clear, for the code that sends it or hands it to the engine: the
        value of ``$api_key_env`` or of ``api_key``; None when neither is set.

        Raises ``ConfigError`` when ``api_key_env`` names an unset variable, or when ``api_key``
        is the placeholder a snapshot holds instead of the key (a config reloaded from config.json).
        """
        if self.api_key_env is not None:
            value = os.environ.get(self.api_key_env, "")
            if not value:
                raise ConfigError(f"worker.api_key_env names ${self.api_key_env}, which is not set (or empty) here; "
                                  f"export it before the gate runs, or unset worker.api_key_env")
            return value
        if self.api_key is None:
            return None
        value = self.api_key.get_secret_value()
        if value in _REDACTED_PLACEHOLDERS:
            raise ConfigError("worker.api_key is the placeholder of a config snapshot, not a key (snapshots keep no "
                              "secrets); give the key again by environment: --set worker.api_key_env=NAME (NAME "
                              "holds the key), or --set worker.api_key=KEY (visible in ps)")
        return value or None

    @field_validator("memory_profile")
    @classmethod
    def _known_profile(cls, v: str) -> str:
        if v not in MEMORY_PROFILES:
            raise ValueError(f"unknown memory profile {v!r}; choose one of {sorted(MEMORY_PROFILES)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _env_replaces_placeholder(cls, data: Any) -> Any:
        # A snapshot (config.json) holds the placeholder where the key was; naming the variable
        # that holds the key (`--set worker.api_key_env=NAME`) is how it is given back.
        if isinstance(data, dict) and data.get("api_key_env") and data.get("api_key") in _REDACTED_PLACEHOLDERS:
            data = {k: v for k, v in data.items() if k != "api_key"}
        return data

    @field_validator("memory", mode="before")
    @classmethod
    def _memory_of_the_engine(cls, value: Any, info: ValidationInfo) -> Any:
        engine = info.data.get("engine")
        if engine not in BUDGET_MODELS:
            return None  # worker.engine's own error says what is wrong; no second one about its budget
        if isinstance(value, dict):
            return budget_fields_for(engine, value)
        if isinstance(value, MemoryBudget) and value.engine != engine:
            raise ValueError(f"is a memory budget for engine {value.engine!r}, but worker.engine is {engine!r}; "
                             f"give {engine}'s fields: {BUDGET_MODELS[engine].field_names()}")
        return value

    @field_serializer("memory")
    def _only_given_memory_fields(self, value: MemoryBudget | None,
                                  info: FieldSerializationInfo) -> dict[str, Any] | None:
        # Only the fields given: a snapshot reloaded (rerun, overrides) lays the same fields over the
        # profile, instead of None over every field the profile sets.
        if value is None:
            return None
        return {"engine": value.engine, **value.model_dump(mode=info.mode, exclude_unset=True)}

    @model_validator(mode="after")
    def _consistent(self) -> "WorkerSpec":
        # The one check that an attaching engine has somewhere to attach (launch relies on it).
        if self.engine == "external" and not self.url:
            raise ValueError("engine 'external' needs url (the base URL of the running server)")
        if self.memory is not None and self.memory.engine != self.engine:
            raise ValueError(f"worker.memory is a budget for engine {self.memory.engine!r}, but worker.engine is "
                             f"{self.engine!r}; give {self.engine}'s fields: "
                             f"{BUDGET_MODELS[self.engine].field_names()}")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give either api_key or api_key_env (the variable that holds the key), not both")
        return self

    def budget(self) -> MemoryBudget:
        """The effective memory budget, of the engine's own model (``BUDGET_MODELS[engine]``): the named
        profile's, with ``memory``'s fields laid over it."""
        base = MEMORY_PROFILES[self.memory_profile].for_engine(self.engine)
        if self.memory is None:
            return base
        return type(base)(**{**base.model_dump(), **self.memory.model_dump(exclude_unset=True)})


class WarmupConfig(_Model):
    enabled: bool = True
    num_requests: int = Field(3, ge=1)
    max_new_tokens: int = Field(64, ge=1, description="SGLang's kits use 64")
    prompt: str = "The capital of France is"
    request_timeout_s: Seconds = 120.0


class FlushConfig(_Model):
    timeout_s: Seconds = Field(60.0, description="how long the server may wait for idle before flushing")
    request_timeout_s: Seconds | None = Field(None, description="HTTP timeout; default timeout_s + 30")


class OneBatchConfig(_Model):
    enabled: bool = True
    mode: Literal["server", "offline"] = "server"
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8])
    input_lens: list[int] = Field(default_factory=lambda: [128])
    output_lens: list[int] = Field(default_factory=lambda: [32])
    repeats: int = Field(1, ge=1, description="measure each case this many times (fresh prompts each); "
                                              "the baseline comparison gates a case from 3 repeats")
    skip_token_capacity_check: bool = False
    request_timeout_s: Seconds = 600.0
    seed: int = 1

    @field_validator("batch_sizes", "input_lens", "output_lens")
    @classmethod
    def _positive_list(cls, v: list[int]) -> list[int]:
        if not v or any(x <= 0 for x in v):
            raise ValueError(f"must be a non-empty list of positive integers, got {v!r}")
        return v


class ServingConfig(_Model):
    enabled: bool = True
    dataset: Literal["random", "sharegpt", "generated-shared-prefix", "trace", "jsonl"] = Field("random", description=(
        "random token ids; sharegpt (dataset_path: ShareGPT JSON); generated-shared-prefix (SGLang's: groups of "
        "requests sharing a long system prompt, gsp_*); trace (dataset_path: a Mooncake-format JSONL trace with "
        "timestamps, replayed on its own schedule); jsonl (dataset_path: one {\"prompt\", \"output_len\"} per line)"))
    dataset_path: str | None = None
    gsp_num_groups: int = Field(4, ge=1, description="generated-shared-prefix: groups (SGLang --gsp-num-groups)")
    gsp_prompts_per_group: int = Field(4, ge=1, description="generated-shared-prefix: requests per group")
    gsp_system_prompt_len: int = Field(256, ge=1, description="generated-shared-prefix: shared prefix tokens")
    gsp_question_len: int = Field(32, ge=1, description="generated-shared-prefix: per-request suffix tokens")
    gsp_output_len: int = Field(32, ge=1, description="generated-shared-prefix: output tokens per request")
    trace_time_scale: float = Field(1.0, gt=0, description=(
        "trace: multiply the trace's timestamps by this (0.5 replays twice as fast; SGLang's "
        "--mooncake-slowdown-factor)"))
    num_prompts: int = Field(16, ge=1)
    random_input_len: int = Field(128, ge=1)
    random_output_len: int = Field(32, ge=1)
    random_range_ratio: float = Field(1.0, ge=0, le=1)
    arrival: Literal["poisson", "gamma", "constant", "all-at-once"] = "poisson"
    request_rate: float = Field(float("inf"), description="requests/s; inf with poisson = all at once")
    burstiness: float = Field(1.0, gt=0, description=(
        "gamma arrivals: the gamma shape (SGLang's and vLLM's --burstiness); inter-arrival gaps have mean "
        "1/request_rate, below 1 burstier than Poisson, 1 is Poisson, above 1 more regular"))
    max_concurrency: int | None = Field(None, ge=1)
    protocol: Literal["native", "openai"] | None = Field(None, description="default: the engine's own")
    seed: int = 1
    slo_ttft_ms: Milliseconds | None = None
    slo_tpot_ms: Milliseconds | None = None
    slo_e2e_ms: Milliseconds | None = None
    max_dispatch_lag_p99_ms: Milliseconds = Field(50.0, description="client fell behind past this")
    invalid_client_retries: int = Field(
        1, ge=0, le=5,
        description="times the load is flushed and run again when the client was not valid (fell behind or "
                    "its arrivals did not fit): a host stall of the load generator, not the engine; each "
                    "discarded attempt is kept as serving_requests_discarded_<n>")
    request_timeout_s: Seconds = 600.0
    progress: bool = True

    @field_validator("request_rate")
    @classmethod
    def _rate(cls, v: float) -> float:
        if math.isnan(v) or v <= 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {v!r}")
        return v

    @model_validator(mode="after")
    def _dataset_needs_path(self) -> "ServingConfig":
        what = {"sharegpt": "a ShareGPT-format JSON file", "trace": "a Mooncake-format JSONL trace",
                "jsonl": "a JSONL file of {\"prompt\": ..., \"output_len\": ...} lines"}
        if self.dataset in what and not self.dataset_path:
            raise ValueError(f"dataset {self.dataset!r} needs dataset_path ({what[self.dataset]})")
        return self


class CapacityConfig(_Model):
    """The capacity stage: a sweep of request rates (like GuideLLM's sweep) that finds the highest rate
    whose goodput under the serving SLOs stays at or above ``goodput_target``; higher is better."""

    enabled: bool = Field(False, description="run the capacity sweep (off by default: it costs many loads)")
    start_rate: float = Field(1.0, gt=0, description="first request rate tried, requests/s")
    growth: float = Field(2.0, gt=1, description="each step multiplies the rate by this until the target fails")
    refine_steps: int = Field(2, ge=0, description="bisection steps between the last good and first bad rate")
    max_rate: float = Field(256.0, gt=0, description="stop raising the rate here (capacity reported as >= max)")
    num_prompts: int = Field(16, ge=2, description="requests per load (serving's dataset and lengths)")
    goodput_target: float = Field(0.9, gt=0, le=1, description=(
        "fraction of requests that must meet serving.slo_ttft_ms / slo_tpot_ms / slo_e2e_ms (at least one set)"))
    request_timeout_s: Seconds = 600.0


class OccupancyConfig(_Model):
    enabled: bool = True
    max_new_tokens: int = Field(2048, ge=1, description="SGLang's kit: 2048")
    scrape_interval_s: Seconds = 0.5
    min_samples: int = Field(3, ge=1)
    max_requests: int = Field(3, ge=1, description=(
        "send the long request again, up to this many in all, while fewer than min_samples scrapes read a "
        "value (a faster machine finishes max_new_tokens sooner)"))
    prompt: str = "Write a long story about a lighthouse keeper."
    request_timeout_s: Seconds = 900.0


class ValidateConfig(_Model):
    expectation_profile: str = Field("smoke", description="expectations/<name>.json")
    expectations_dir: str | None = Field(None, description="default: the project's expectations/")

    @field_validator("expectation_profile")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # A name, not a path: "../../x" must not read a suite from outside expectations_dir.
        if not _PLAIN_NAME_RE.match(v) or ".." in v:
            raise ValueError(f"must be a suite name (expectations/<name>.json: letters, digits, '.', '_', '-'), "
                             f"got {v!r}; to use suites from another folder set validate.expectations_dir")
        return v


class QualityConfig(_Model):
    """The quality stage: multiple-choice accuracy floor and reference agreement."""

    enabled: bool = Field(True, description="run the quality stage")
    dataset_path: str = Field(str(QUALITY_DATA_DIR / "commonsense_mc.jsonl"),
                              description="HellaSwag-format JSONL (ctx, endings, label); default: the shipped set")
    max_items: int | None = Field(None, ge=1, description="score a seeded sample of this many items (None: all)")
    reference_prompts_path: str = Field(str(QUALITY_DATA_DIR / "reference_prompts.json"),
                                        description="JSON list of {id, prompt} for reference agreement")
    reference_max_new_tokens: int = Field(16, ge=1, description="greedy tokens generated per reference prompt")
    exact_match_tokens: int = Field(16, ge=1, description="N: the first N output tokens must match exactly")
    logprob_tolerance: float = Field(0.3, gt=0, description="allowed |worker - reference| per-token logprob and "
                                                            "greedy gap, nats (bf16 worker vs fp32: <= 0.14 measured)")
    reference: str = Field("in-process", description="'in-process' (transformers fp32 run of the model) or the "
                                                     "path to a stored reference file (record_reference)")
    seed: int = Field(1, description="seed of the max_items sample")
    request_timeout_s: Seconds = Field(300.0, description="HTTP timeout per request")
    concurrency: int = Field(4, ge=1, description="requests in flight at once")

    @field_validator("logprob_tolerance")
    @classmethod
    def _finite(cls, v: float) -> float:
        if math.isnan(v) or math.isinf(v):
            raise ValueError(f"must be a finite number > 0, got {v!r}")
        return v

    @model_validator(mode="after")
    def _n_within_generated(self) -> "QualityConfig":
        if self.exact_match_tokens > self.reference_max_new_tokens:
            raise ValueError(f"exact_match_tokens ({self.exact_match_tokens}) exceeds reference_max_new_tokens "
                             f"({self.reference_max_new_tokens}); raise reference_max_new_tokens or lower N")
        return self


class CompareConfig(_Model):
    """Noise-aware comparison with the gate key's baseline (history in the store).

    Off in ``smoke`` so that a fresh clone's first gate can pass; a nightly profile turns it
    on, and then too little history is *inconclusive*, never a pass.
    """

    enabled: bool = False
    policy: Literal["last_n", "pinned", "window"] = Field("last_n", description="how the baseline is chosen")
    n: int = Field(5, ge=1, description="last_n: how many passing runs")
    branch: str | None = Field(None, description="last_n: reference branch (None = any)")
    days: Days | None = Field(None, description="window: how many days back")
    bound: float = Field(0.05, gt=0, lt=1, description="minimum effect size on medians (0.05 = 5 %)")
    tail_bound: float = Field(0.10, gt=0, lt=1, description="minimum effect size on p99 tails")
    consecutive: int = Field(1, ge=1, le=10, description=(
        "history rule (as PyTorch HUD's policies): a gated metric is a regression only when this run and the "
        "consecutive-1 runs of the gate key before it all showed it regressed; fewer -> 'suspicious' "
        "(shown, and the gate is undecided, exit 2: never a pass). 1 = every regression counts at once"))


class StoreConfig(_Model):
    enabled: bool = Field(True, description="record every run in the history database")
    url: str | None = Field(None, description="SQLAlchemy URL or SQLite path; default $SERVEGATE_DB or "
                                              "~/.local/share/servegate/history.db. A password in it is "
                                              "shown as *** in every snapshot: prefer $SERVEGATE_DB")

    @field_serializer("url", when_used="json")
    def _hide_password(self, value: str | None) -> str | None:
        return redact_url(value)


class HostConfig(_Model):
    """Checks of the machine before the first measurement (``servegate.hostcheck``).

    A gate measures latency on a shared host: another process holding a core, or a compute process
    on the GPU, moves the figures more than the regressions the gate looks for. A host that fails a
    check makes the run inconclusive, never a measurement. The environment record (``host.json``) is
    written whether the checks are on or not.
    """

    enabled: bool = Field(True, description="check the host before measuring (off: record it only)")
    sample_s: Seconds = Field(2.0, description="how long other processes' CPU use is sampled")
    max_other_cpu_cores: Annotated[float, BeforeValidator(_not_bool)] = Field(
        0.5, ge=0, allow_inf_nan=False, description=(
        "most CPU that processes outside the gate's own tree, its ancestors and its host group (the processes "
        "whose environment carries the gate's SERVEGATE_HOST_GROUP value, and their descendants) may hold during the sample, in cores "
        "(0.5 = half a core; a busy-loop neighbour holds 1.0)"))
    foreign_gpu_processes: bool = Field(False, description=(
        "allow compute processes that are not the gate's on the GPUs its workers see (nvidia-smi; "
        "CUDA_VISIBLE_DEVICES, all GPUs when unset); false: they fail the check"))


class CostConfig(_Model):
    """What the worker's machine costs, for the cost per million output tokens (``servegate.cost``).

    Unset (the default), no cost is computed or shown: a cost of 0 would read as a free machine.
    """

    price_per_hour: Annotated[float | None, BeforeValidator(_not_bool)] = Field(None, description=(
        "what the worker's machine costs per hour (e.g. 2.5 for an on-demand GPU at 2.50 an hour), finite and "
        "> 0; unset: no cost figure"))
    currency: str = Field("USD", pattern=r"^[A-Z]{3}$", description="ISO 4217 code of price_per_hour (USD, EUR)")

    @field_validator("price_per_hour")
    @classmethod
    def _price(cls, v: float | None) -> float | None:
        if v is not None and (math.isnan(v) or math.isinf(v) or v <= 0):
            raise ValueError(f"must be a finite number > 0 (price per hour), got {v!r}; leave it unset for no cost")
        return v


class ReportConfig(_Model):
    html: bool = Field(True, description="write report.html into the run folder (matplotlib plots)")


PAIRED_METRICS: dict[str, tuple[str, str]] = {
    "itl_median_ms": ("median_itl_ms", "lower_is_better"),
    "tpot_median_ms": ("median_tpot_ms", "lower_is_better"),
    "ttft_median_ms": ("median_ttft_ms", "lower_is_better"),
    "e2e_median_ms": ("median_e2e_latency_ms", "lower_is_better"),
    "output_throughput": ("output_throughput", "higher_is_better"),
    "cpu_ms_per_token": ("worker_cpu_ms_per_output_token", "lower_is_better"),
}
"""What the paired stage measures per block: metric -> (serving summary column, direction). The last is not
the client's: the worker's own CPU time (its process tree's user + system) over its block, per output token,
read around the load (docs/paired.md: what belongs to each side of a duet)."""


class PairedConfig(_Model):
    """Paired, interleaved, sequential measurement of ``baseline`` (A) against ``worker`` (B).

    Each round measures one block of the same fresh prompts on A and on B back to back (ABBA
    order across rounds, or random), each from a flushed, idle worker; per metric the round's
    log ratio B/A is one sample, so drift between rounds cancels. Rounds go on until every gated
    metric is decided (a group-sequential repeated confidence interval, ``servegate.paired.stats``)
    or ``max_measure_s`` / ``max_rounds`` is reached. Both workers are restarted every
    ``rounds_per_worker`` rounds so that process-level effects are sampled too.
    """

    enabled: bool = Field(True, description="run the paired stage when a baseline worker is configured")
    mode: Literal["interleaved", "duet"] = Field("interleaved", description=(
        "interleaved: A and B one after the other; duet: both at once, on worker.cpus and baseline.cpus: the same "
        "set (both time-sliced on its cores: each sees the same moment of each core; smoke-ab) or disjoint sets "
        "(swapped every other instance pair)"))
    order: Literal["abba", "random"] = Field("abba", description="AB, BA, AB, ... or a seeded random order per round")
    requests_per_block: int = Field(4, ge=1, description="streaming requests per block, sent at once")
    input_len: int = Field(64, ge=1, description="prompt tokens per request (random prompts, fresh each round)")
    output_len: int = Field(64, ge=2, description="generated tokens per request (ignore_eos)")
    min_rounds: int = Field(10, ge=3, description="rounds before the first decision is looked at")
    min_units: int = Field(10, ge=3, description=(
        "samples before the first decision, the first look of the sequential design: worker instance pairs when "
        "the workers restart during the measurement (rounds_per_worker < max_rounds), else rounds"))
    max_rounds: int = Field(40, ge=3, description=(
        "stop after this many rounds (undecided metrics: inconclusive); also the last look of the sequential "
        "design (max_rounds // rounds_per_worker instance pairs when restarting): set it to what max_measure_s "
        "holds, since a design planned for more looks than are made spends less of its error rate, and a "
        "wider interval, at each of them"))
    max_measure_s: Seconds = Field(600.0, description=(
        "measurement budget: no round starts that is expected (median of the last 4 rounds, restart included) "
        "to end past it; stage_max_s is the hard limit"))
    warmup_blocks: int = Field(1, ge=0, description=(
        "blocks of the measured workload each new worker instance serves, unmeasured, after [warmup] and "
        "before its first round: a fresh worker's first block is not its steady state (docs/paired.md)"))
    rounds_per_worker: int = Field(2, ge=1, description=(
        "restart both workers every this many rounds (one AB + BA pair per instance at 2); the interval is "
        "then over instance pairs, whose offsets (memory layout, allocator, threads) it samples"))
    bound: float = Field(0.015, gt=0, lt=1, description="the smallest change that counts (0.015 = 1.5 %)")
    confidence: float = Field(0.95, gt=0.5, lt=1, description=(
        "coverage of the repeated confidence interval, over all looks"))
    gated: list[str] = Field(default_factory=lambda: ["itl_median_ms"], description=(
        f"metrics that decide the verdict, of {list(PAIRED_METRICS)}; the others are reported"))
    sd_floor: float = Field(0.005, ge=0, lt=1, description=(
        "smallest per-round sd of the log ratio the interval assumes (guards the first rounds against a lucky "
        "small spread)"))
    confirm: bool = Field(True, description=(
        "re-measure a gated metric found regressed, with fresh workers and fresh prompts, before it fails the "
        "gate: reproduced -> regression; excluded -> 'unconfirmed' (shown, not a failure); neither -> inconclusive"))
    profile: bool = Field(True, description=(
        "after a confirmed regression, record one profiler trace of each side on the same block of requests "
        "through the engine's own profiler endpoints, keep both traces in the run folder and show the operators "
        "whose time changed most (needs paired.confirm; engines without a profiler: not applicable)"))
    client_cpus: list[int] | None = Field(None, description="pin the load generator's thread(s) to these CPUs")
    seed: int = Field(1, description="seed of the prompts (round r uses seed + r) and of a random order")
    request_timeout_s: Seconds = Field(300.0, description="HTTP timeout per request")

    @field_validator("gated")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        unknown = [m for m in v if m not in PAIRED_METRICS]
        if unknown or not v:
            raise ValueError(f"must name at least one of {list(PAIRED_METRICS)}, got {v!r}")
        return v

    @field_validator("client_cpus")
    @classmethod
    def _cpus_exist(cls, v: list[int] | None) -> list[int] | None:
        return _check_cpus(v)

    @model_validator(mode="after")
    def _rounds(self) -> "PairedConfig":
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds ({self.max_rounds}) is below min_rounds ({self.min_rounds})")
        if self.rounds_per_worker < self.max_rounds and self.max_rounds // self.rounds_per_worker < self.min_units:
            raise ValueError(
                f"max_rounds ({self.max_rounds}) holds {self.max_rounds // self.rounds_per_worker} worker instance "
                f"pair(s) of rounds_per_worker = {self.rounds_per_worker}, fewer than min_units ({self.min_units}): "
                f"nothing could ever be decided; raise max_rounds or lower min_units")
        if self.rounds_per_worker >= self.max_rounds and self.max_rounds < self.min_units:
            raise ValueError(f"max_rounds ({self.max_rounds}) is below min_units ({self.min_units}): nothing could "
                             f"ever be decided")
        return self


class GateConfig(_Model):
    name: str = Field("smoke", description="gate name (part of the gate key)")
    hardware: str = Field("cpu", description="hardware profile (part of the gate key)")
    worker: WorkerSpec = Field(default_factory=WorkerSpec)
    baseline: WorkerSpec | None = Field(None, description=(
        "the baseline worker (A) the paired stage measures the candidate `worker` (B) against: same schema, "
        "what differs between the builds (python, extra_args, env, model); same memory budget"))
    paired: PairedConfig = Field(default_factory=PairedConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    flush: FlushConfig = Field(default_factory=FlushConfig)
    one_batch: OneBatchConfig = Field(default_factory=OneBatchConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    occupancy: OccupancyConfig = Field(default_factory=OccupancyConfig)
    quality: QualityConfig = Field(default_factory=QualityConfig)
    capacity: CapacityConfig = Field(default_factory=CapacityConfig)
    validate_: ValidateConfig = Field(default_factory=ValidateConfig, alias="validate")
    compare: CompareConfig = Field(default_factory=CompareConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    host: HostConfig = Field(default_factory=HostConfig)
    cost: CostConfig = Field(default_factory=CostConfig)
    output_dir: str = Field("runs", description="run folders are created under this folder")
    max_wall_s: Seconds = Field(4 * 3600.0, description=(
        "the gate's deadline from its start: a stage still running then is stopped (its worker with it) and "
        "the stages left are not measured; the verdict is inconclusive"))
    stage_max_s: Seconds = Field(3600.0, description=(
        "longest any one stage may run (launch, warm-up, a flush, a measurement); past it, as for max_wall_s"))

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)

    @model_validator(mode="after")
    def _same_budget(self) -> "GateConfig":
        # A paired comparison of two budgets measures the budgets, not the builds.
        if self.baseline is not None and self.baseline.engine == self.worker.engine:
            a, b = self.baseline.budget().model_dump(), self.worker.budget().model_dump()
            if a != b:
                raise ValueError(f"baseline and worker must have the same memory budget (baseline {a}, worker {b}); "
                                 f"set the same memory_profile / memory on both")
        elif self.baseline is not None and self.baseline.memory_profile != self.worker.memory_profile:
            raise ValueError(f"baseline ({self.baseline.engine}) and worker ({self.worker.engine}) must use the same "
                             f"memory_profile, got {self.baseline.memory_profile!r} and {self.worker.memory_profile!r}")
        return self

    @property
    def is_paired(self) -> bool:
        """A baseline worker is configured and the paired stage is on."""
        return self.baseline is not None and self.paired.enabled


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid gate config ({source}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  - {loc} = {value!r}: {msg}")
    return "\n".join(lines)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML/YAML file or --profile "
                          f"one of {available_profiles()}")
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text())
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
            return data
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path} is not valid {path.suffix[1:].upper()}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a UTF-8 text file ({exc.reason} at byte {exc.start}); pass a TOML or YAML "
                          f"gate config") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    raise ConfigError(f"{path}: unsupported config format {path.suffix!r}; use .toml, .yaml or .yml")


def _parse_override_value(raw: str) -> Any:
    """Parse a CLI override value as YAML scalar/list (so 'inf', '[1,2]', 'true' work)."""
    low = raw.strip().lower()
    if low in ("inf", "+inf", "infinity"):
        return float("inf")
    if low in ("-inf", "-infinity"):
        return float("-inf")
    if low == "nan":
        return float("nan")
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a raw config mapping (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value (e.g. flush.timeout_s=30)")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r} has an empty key")
        node = data
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = nxt
        node[parts[-1]] = _parse_override_value(raw)
    return data


def load_config(path: str | Path | None = None, profile: str | None = None,
                overrides: list[str] | None = None) -> GateConfig:
    """Load a gate config from a file or a shipped profile, apply overrides, validate."""
    if path is not None and profile is not None:
        raise ConfigError("give either a config file or a profile, not both")
    if path is not None:
        source = str(path)
        data = _read_file(Path(path))
    else:
        profile = profile or "smoke"
        # Only the shipped names: "../../x" must not load a TOML from outside the profiles folder.
        if profile not in available_profiles():
            raise ConfigError(f"unknown profile {profile!r}; choose one of {available_profiles()}, or give a "
                              f"config file instead of a profile")
        source = f"profile {profile}"
        data = _read_file(PROFILES_DIR / f"{profile}.toml")
    data = apply_overrides(data, list(overrides or []))
    try:
        return GateConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from exc
