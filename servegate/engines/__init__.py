"""Engines: one small module each, behind the narrow interface in ``base.py``."""

from __future__ import annotations

from servegate.engines.base import Engine, Protocol, ServerCapacity
from servegate.engines.embedded import EmbeddedEngine
from servegate.engines.external import ExternalEngine
from servegate.engines.sglang import SGLangEngine
from servegate.engines.transformers_serve import TransformersServeEngine
from servegate.engines.vllm import VLLMEngine
from servegate.errors import ConfigError

__all__ = ["Engine", "Protocol", "ServerCapacity", "ENGINES", "get_engine",
           "EmbeddedEngine", "ExternalEngine", "SGLangEngine", "TransformersServeEngine", "VLLMEngine"]

ENGINES: dict[str, type[Engine]] = {
    "embedded": EmbeddedEngine,
    "sglang": SGLangEngine,
    "vllm": VLLMEngine,
    "external": ExternalEngine,
    "transformers": TransformersServeEngine,
}


def get_engine(name: str) -> Engine:
    """The engine called ``name``; ``ConfigError`` listing the valid names otherwise."""
    try:
        return ENGINES[name]()
    except KeyError:
        raise ConfigError(f"unknown engine {name!r}; choose one of {sorted(ENGINES)}") from None
