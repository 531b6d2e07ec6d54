"""The one exception tree of servegate.

Every error servegate raises is a ``ServegateError``; foreign exceptions (requests,
aiohttp, psutil, pydantic, GX) are mapped at the boundary with ``raise ... from exc``.
Each message says what went wrong *and what to do next*.

::

    ServegateError
    ├── ConfigError                 bad input: invalid config, unknown profile   -> exit 2
    ├── InfraError                  the gate could not decide                     -> inconclusive, exit 2
    │   ├── WorkerLaunchError       the worker did not become ready
    │   │   └── WorkerOOMError      it was SIGKILLed during start-up (likely OOM)
    │   ├── WorkerDiedError         the worker exited while being measured
    │   ├── ServerUnreachableError  no HTTP answer from the server
    │   ├── FlushError              the prefix cache could not be flushed (busy, refused)
    │   ├── MetricsError            /metrics missing, malformed, or a gauge absent
    │   ├── InsufficientDataError   too few samples to decide
    │   ├── ModelUnavailableError   model not cached and cannot be fetched
    │   ├── DeadlineError           a stage or the gate ran past stage_max_s / max_wall_s
    │   └── StageError              a stage could not produce its measurement (e.g. warmup failed)
    │       └── RequestDeadlineError  one request did not end within its deadline (stalled, dripping)
    └── ValidationSetupError        an expectation suite is missing or malformed  -> exit 2

A *regression* is not an exception: it is a verdict (``fail``, exit 1) built from
expectation results. Infra failures are never reported as regressions.
"""

from __future__ import annotations

__all__ = [
    "ServegateError",
    "ConfigError",
    "InfraError",
    "WorkerLaunchError",
    "WorkerOOMError",
    "WorkerDiedError",
    "ServerUnreachableError",
    "FlushError",
    "MetricsError",
    "InsufficientDataError",
    "ModelUnavailableError",
    "DeadlineError",
    "StageError",
    "RequestDeadlineError",
    "ValidationSetupError",
]


class ServegateError(Exception):
    """Base of every error servegate raises."""


class ConfigError(ServegateError):
    """Invalid configuration or command-line input; names the field, value and what is allowed."""


class InfraError(ServegateError):
    """The infrastructure broke, so the gate cannot decide (verdict: inconclusive)."""


class WorkerLaunchError(InfraError):
    """The inference worker failed to start or become ready."""


class WorkerOOMError(WorkerLaunchError):
    """The worker was killed by SIGKILL during start-up: most likely the OOM killer."""


class WorkerDiedError(InfraError):
    """The worker process exited while the gate was using it."""


class ServerUnreachableError(InfraError):
    """The server did not answer over HTTP."""


class FlushError(InfraError):
    """The server refused to flush its prefix cache or stayed busy past the timeout."""


class MetricsError(InfraError):
    """The metrics endpoint is missing, malformed, or lacks a required gauge."""


class InsufficientDataError(InfraError):
    """Too few samples (or too little history) to reach a verdict."""


class ModelUnavailableError(InfraError):
    """The model is not in the local cache and cannot be fetched."""


class DeadlineError(InfraError):
    """A stage or the whole gate ran past its deadline (``stage_max_s``, ``max_wall_s``)."""


class StageError(InfraError):
    """A stage could not produce its measurement."""


class RequestDeadlineError(StageError):
    """One HTTP request did not end (send to last byte) within its deadline: a stalled or dripping server."""


class ValidationSetupError(ServegateError):
    """An expectation suite is missing or malformed."""
