"""The generation protocols the gate speaks, one ``WireProtocol`` object each.

::

    base      WireProtocol (the interface), TokenStream, BatchTally, StreamEvent, check_count_within
    native    NativeProtocol: SGLang's POST /generate (SGLang, the embedded worker)
    openai    OpenAIProtocol: POST /v1/completions (vLLM, OpenAI-compatible servers);
              OpenAITextProtocol: its strict-schema dialect, "openai-text" (transformers serve)
    sse       Server-Sent Events framing both stream in (SSEDecoder, parse_sse_line)

A stage gets its engine's protocol with ``protocol_for(engine)`` and asks it for the URL, the
request body, what a streamed chunk means, the checked token counts and the log-probabilities;
no stage branches on the protocol's name. Output tokens are always counted from the server's
own counters, never by tokenizing chunks on the client (which would cost CPU in the load
generator and disagree with the server's tokenizer), and those counters are checked
(``base``, ``native`` and ``openai`` say how).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from servegate.bench.protocol.base import (
    BatchTally,
    Prompt,
    StreamEvent,
    TokenStream,
    WireProtocol,
    check_count_within,
    last_completion_tokens,
)
from servegate.bench.protocol.native import (
    GENERATE_PATH,
    NativeCountCheck,
    NativeProtocol,
    native_event,
    native_generate_body,
    native_output_id_count,
)
from servegate.bench.protocol.openai import (
    COMPLETIONS_PATH,
    OpenAIProtocol,
    OpenAITextProtocol,
    openai_completions_body,
    openai_events,
    openai_usage,
)
from servegate.bench.protocol.sse import SSE_DONE, SSEDecoder, parse_sse_line, parse_sse_payload
from servegate.errors import ConfigError

if TYPE_CHECKING:  # engines do not import bench; kept out of the import graph all the same
    from servegate.engines.base import Engine

__all__ = [
    "WireProtocol",
    "NativeProtocol",
    "OpenAIProtocol",
    "OpenAITextProtocol",
    "NATIVE",
    "OPENAI",
    "OPENAI_TEXT",
    "PROTOCOLS",
    "protocol_for",
    "protocol_named",
    "Prompt",
    "StreamEvent",
    "TokenStream",
    "BatchTally",
    "check_count_within",
    "NativeCountCheck",
    "GENERATE_PATH",
    "COMPLETIONS_PATH",
    "SSE_DONE",
    "SSEDecoder",
    "parse_sse_line",
    "parse_sse_payload",
    "native_generate_body",
    "native_event",
    "last_completion_tokens",
    "native_output_id_count",
    "openai_completions_body",
    "openai_events",
    "openai_usage",
]

NATIVE: Final = NativeProtocol()
OPENAI: Final = OpenAIProtocol()
OPENAI_TEXT: Final = OpenAITextProtocol()
PROTOCOLS: Final[dict[str, WireProtocol]] = {p.name: p for p in (NATIVE, OPENAI, OPENAI_TEXT)}
"""Protocol name (an engine's ``protocol`` attribute, ``serving.protocol``) -> its object."""


def protocol_named(name: str) -> WireProtocol:
    """The protocol called ``name``; ``ConfigError`` listing the choices for any other name."""
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ConfigError(f"unknown protocol {name!r}; choose one of {sorted(PROTOCOLS)}") from None


def protocol_for(engine: Engine, override: str | None = None) -> WireProtocol:
    """The protocol to speak to ``engine``: its own (``engine.protocol``), or ``override`` when set
    (``serving.protocol``, e.g. OpenAI routes on an SGLang server)."""
    return protocol_named(override or engine.protocol)

