"""SGLang's native protocol: ``POST /generate``.

Requests: ``input_ids`` or ``text``, single or a list (a batch, one request);
``sampling_params``; ``stream``. A streamed batch sends one SSE chunk per request ``index``;
each chunk carries the cumulative ``meta_info.completion_tokens`` and ``output_ids`` (SGLang's
default: cumulative; ``--stream-output``: incremental). Log-probabilities: ``return_logprob``
with ``logprob_start_len``; ``meta_info.input_token_logprobs`` / ``output_token_logprobs`` as
``[logprob, token_id, text-or-null]`` triples (entry 0 of the input ones is None).

Token counts are checked (``base``'s docstring says why): besides the shared bound, when
chunks carry ``output_ids`` (SGLang and the embedded worker do) the final ``completion_tokens``
must equal the number of output ids streamed — the last chunk's (cumulative ids) or their sum
over the chunks (incremental ids); see ``NativeCountCheck``. This holds whatever the tokens
per chunk. A count that goes down within a stream is rejected too.

SGLang streams the cumulative ``text`` and ``output_ids`` in every chunk, so decoding each
chunk costs O(tokens so far): the serving load generator's ``NativeTokenStream`` reads only
the counter (``base.last_completion_tokens``) and, while they matter, the ids
(``native_output_id_count``), at the bytes level, and decodes only the last chunk in full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Final

from servegate.bench.protocol.base import (
    BatchTally,
    Prompt,
    StreamEvent,
    TokenStream,
    WireProtocol,
    check_count_within,
    chunk_error,
    last_completion_tokens,
)
from servegate.bench.protocol.sse import SSE_DONE, parse_sse_payload
from servegate.errors import StageError

__all__ = [
    "GENERATE_PATH",
    "NativeProtocol",
    "NativeTokenStream",
    "NativeBatchTally",
    "NativeCountCheck",
    "native_generate_body",
    "native_event",
    "native_output_id_count",
]

GENERATE_PATH: Final = "/generate"

_IDS_KEY: Final = b'"output_ids":'


def native_generate_body(prompt: Prompt | list[Prompt], max_new_tokens: int, *, stream: bool | None,
                         ignore_eos: bool | None = True, temperature: float = 0.0) -> dict[str, Any]:
    """Body of SGLang's ``POST /generate`` for one prompt or a batch (a list of prompts).

    Token ids go in ``input_ids`` (a list of ints, or a list of lists for a batch); text in
    ``text``. A batch of text and ids cannot be mixed. ``stream``/``ignore_eos`` None: left out.
    """
    key = "text" if _is_text(prompt) else "input_ids"
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    if ignore_eos is not None:
        sampling["ignore_eos"] = ignore_eos
    body: dict[str, Any] = {key: prompt, "sampling_params": sampling}
    if stream is not None:
        body["stream"] = stream
    return body


def _is_text(prompt: Prompt | list[Prompt]) -> bool:
    if isinstance(prompt, str):
        return True
    return bool(prompt) and isinstance(prompt[0], str)


def native_event(data: dict[str, Any]) -> StreamEvent:
    """One ``/generate`` stream chunk -> its request index and cumulative token count."""
    chunk_error(data)
    try:
        meta = data.get("meta_info") or {}
        ids = data.get("output_ids")
        n_ids = len(ids) if isinstance(ids, list) else None
        completion = meta.get("completion_tokens")
        if completion is None:
            completion = n_ids
        prompt = meta.get("prompt_tokens")
        return StreamEvent(
            index=int(data.get("index", 0)),
            completion_tokens=int(completion) if completion is not None else None,
            prompt_tokens=int(prompt) if prompt is not None else None,
            finished=meta.get("finish_reason") is not None,
            output_ids=n_ids,
        )
    except (AttributeError, TypeError, ValueError) as exc:
        raise StageError(f"malformed /generate stream chunk ({exc}): {str(data)[:200]}") from exc


def native_output_id_count(payload: bytes) -> int | None:
    """How many ``output_ids`` a ``/generate`` chunk carries, read at the bytes level (commas
    between the brackets); None when the chunk has no ``output_ids`` list."""
    k = payload.rfind(_IDS_KEY)
    if k < 0:
        return None
    k += len(_IDS_KEY)
    start = payload.find(b"[", k)
    if start < 0 or payload[k:start].strip():
        return None
    end = payload.find(b"]", start)
    if end < 0:
        return None
    if end - start < 8 and not payload[start + 1:end].strip():
        return 0
    return payload.count(b",", start, end) + 1


class NativeCountCheck:
    """Holds one native stream's final ``completion_tokens`` to the ``output_ids`` it streamed.

    SGLang sends ``output_ids`` cumulatively by default and incrementally with
    ``--stream-output``, and a server may render a chunk while its engine appends a token
    (the embedded worker does), so a mid-stream chunk's count may run one ahead of its ids.
    Only the end is judged therefore: the final count must equal the last chunk's ids (a
    cumulative stream) or the ids summed over the stream (an incremental one). Feed every
    chunk with ``chunk(count, n_ids)`` while ``wants_ids``: the sum is kept only while it
    could still be the count (not larger) — a cumulative stream outgrows it by its second
    chunk, after which its ids need not be read; ``n_ids`` None (a chunk without
    ``output_ids``) turns the check off. Then ``finish`` with the last chunk's ids.
    """

    __slots__ = ("count", "ids_sum", "wants_ids", "off")

    def __init__(self) -> None:
        self.count = 0
        self.ids_sum = 0
        self.wants_ids = True
        """Whether the next chunk's ids still matter (a plain attribute: read once per chunk)."""
        self.off = False

    def chunk(self, count: int, n_ids: int | None) -> None:
        if count < self.count:
            raise StageError(f"the server's completion_tokens went down from {self.count} to {count} within one "
                             f"stream; a cumulative count never does — the server's token accounting is broken")
        self.count = count
        if n_ids is None:
            self.off, self.wants_ids = True, False
            return
        self.ids_sum += n_ids
        if self.ids_sum > count:
            self.wants_ids = False  # not incremental: cumulative (or lying), the last chunk decides

    def finish(self, count: int, last_chunk_ids: int | None) -> None:
        """After the stream: its final count and the ``output_ids`` of its last chunk."""
        if self.off or last_chunk_ids is None or count == last_chunk_ids:
            return
        if self.wants_ids and count == self.ids_sum:
            return
        streamed = (f"its last chunk carries {last_chunk_ids} output ids" if not self.wants_ids else
                    f"its output ids add up to neither ({last_chunk_ids} in its last chunk, as a cumulative "
                    f"stream sends them; {self.ids_sum} summed over its chunks, as an incremental one does)")
        raise StageError(f"the server reported {count} completion tokens but {streamed}: its token count "
                         f"disagrees with the tokens it sent, so TPOT and throughput from it would be false — "
                         f"the request is failed; the server's token accounting is broken")


class NativeTokenStream(TokenStream):
    """A ``/generate`` stream read at the bytes level (module docstring)."""

    __slots__ = ("ids",)

    def __init__(self) -> None:
        super().__init__()
        self.ids = NativeCountCheck()

    def _take(self, payloads: list[bytes], ts: float) -> bool:
        # The hot path: runs once per streamed chunk, in the socket callback.
        count = self.count
        self.end_ts = ts
        for payload in payloads:
            if payload == b"[DONE]":
                self.done = True
                break
            new_count = last_completion_tokens(payload)
            if new_count is None:
                new_count = self._decoded_count(payload, count)
            if self.ids.wants_ids:
                self.ids.chunk(new_count, native_output_id_count(payload))
            self.last_payload = payload
            if new_count > count:
                count = new_count
        if count > self.count:
            self._arrived(ts, count)  # one arrival per read (TokenStream._arrived)
        self.count = count
        return self.done

    @staticmethod
    def _decoded_count(payload: bytes, count: int) -> int:
        """A chunk without a readable counter: decoded (``StageError`` on an error chunk)."""
        data = parse_sse_payload(payload)
        if data is SSE_DONE:
            return count
        ev = native_event(data)  # type: ignore[arg-type]
        return ev.completion_tokens if ev.completion_tokens is not None else count + 1

    def final_prompt_tokens(self) -> int | None:
        if not self.last_payload:
            return None
        last = parse_sse_payload(self.last_payload)
        return None if last is SSE_DONE else native_event(last).prompt_tokens  # type: ignore[arg-type]

    def count_error(self, max_tokens: int) -> str | None:
        try:
            last_ids = native_output_id_count(self.last_payload) if self.last_payload else None
            self.ids.finish(self.count, last_ids)
            check_count_within(self.count, max_tokens, f"a request of max tokens {max_tokens}")
        except StageError as exc:
            return str(exc)
        return None


class NativeBatchTally(BatchTally):
    """A streamed batched ``/generate``: one chunk per prompt ``index``; each prompt's count is
    held to the output ids it streamed (``NativeCountCheck``)."""

    def __init__(self, protocol: WireProtocol, batch_size: int, max_tokens: int) -> None:
        super().__init__(protocol, batch_size, max_tokens)
        self._checks: dict[int, NativeCountCheck] = {}
        self._last_ids: dict[int, int | None] = {}

    def _count(self, ev: StreamEvent) -> None:
        self._checks.setdefault(ev.index, NativeCountCheck()).chunk(ev.completion_tokens or 0, ev.output_ids)
        self._last_ids[ev.index] = ev.output_ids

    def _check_prompt(self, index: int, count: int) -> None:
        self._checks[index].finish(count, self._last_ids[index])

    def _counted_total(self) -> int | None:
        return sum(self.tokens.values()) if len(self.tokens) == self.batch_size else None


class NativeProtocol(WireProtocol):
    """SGLang-native ``POST /generate`` (SGLang, the embedded worker)."""

    name: ClassVar[str] = "native"
    path: ClassVar[str] = GENERATE_PATH
    needs_model: ClassVar[bool] = False
    no_logprobs_hint: ClassVar[str] = ("the server must support SGLang's return_logprob / logprob_start_len on "
                                       "/generate (meta_info.input_token_logprobs)")

    def body(self, prompt: Prompt | list[Prompt], max_tokens: int, *, model: str | None = None,
             stream: bool | None, ignore_eos: bool | None = True, temperature: float = 0.0) -> dict[str, Any]:
        return native_generate_body(prompt, max_tokens, stream=stream, ignore_eos=ignore_eos,
                                    temperature=temperature)

    def has_output(self, doc: Any) -> bool:
        if not isinstance(doc, dict):
            return False
        meta = doc.get("meta_info") or {}
        return bool(doc.get("text")) or bool(doc.get("output_ids")) or bool(meta.get("completion_tokens"))

    def check_counts(self, doc: dict[str, Any], max_tokens: int, what: str) -> None:
        reported = (doc.get("meta_info") or {}).get("completion_tokens")
        ids = doc.get("output_ids")
        if isinstance(reported, int) and isinstance(ids, list) and reported != len(ids):
            raise StageError(f"the server reported {reported} completion tokens for {what} but returned "
                             f"{len(ids)} output ids; its token accounting is broken")
        if isinstance(reported, int):
            check_count_within(reported, max_tokens, what)

    def events(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        return [native_event(chunk)]

    def batch_tally(self, batch_size: int, max_tokens: int) -> BatchTally:
        return NativeBatchTally(self, batch_size, max_tokens)

    def token_stream(self) -> TokenStream:
        return NativeTokenStream()

    def scoring_body(self, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                     model: str | None = None) -> dict[str, Any]:
        return {
            "input_ids": [list(ctx_ids) + list(e) for e in ending_ids],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            # Entry 0 of input_token_logprobs is always None (SGLang), so start one before the ending.
            "logprob_start_len": len(ctx_ids) - 1,
        }

    def ending_logprobs(self, doc: Any, ctx_ids: Sequence[int], ending_ids: Sequence[Sequence[int]],
                        what: str) -> list[list[float]]:
        if not isinstance(doc, list) or len(doc) != len(ending_ids):
            raise StageError(f"{what}: /generate with {len(ending_ids)} input_ids answered {type(doc).__name__} of "
                             f"length {len(doc) if isinstance(doc, list) else '-'}; a batched request must answer "
                             f"a list with one result per prompt")
        per_ending = []
        for result, ending in zip(doc, ending_ids):
            meta = result.get("meta_info") if isinstance(result, dict) else None
            triples = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
            if not isinstance(triples, list) or len(triples) < len(ending):
                raise StageError(f"{what}: no usable meta_info.input_token_logprobs in {str(result)[:300]!r}; "
                                 f"{self.no_logprobs_hint}")
            tail = triples[len(triples) - len(ending):]
            try:
                ids = [int(t[1]) for t in tail]
                values = [math.nan if t[0] is None else float(t[0]) for t in tail]
            except (TypeError, ValueError, IndexError) as exc:
                raise StageError(f"{what}: malformed input_token_logprobs {tail!r}; expected "
                                 f"[logprob, token_id, text] triples") from exc
            if ids != list(ending):
                raise StageError(f"{what}: the server scored tokens {ids} where the ending is {list(ending)}; it "
                                 f"must honour input_ids and logprob_start_len as SGLang does")
            per_ending.append(values)
        return per_ending

    def greedy_body(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    model: str | None = None) -> dict[str, Any]:
        return {"input_ids": [[int(t) for t in p] for p in prompts], "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}

    def greedy_outputs(self, doc: Any, n_prompts: int, what: str) -> list[tuple[list[int], list[float | None]]]:
        if not isinstance(doc, list) or len(doc) != n_prompts:
            raise StageError(f"{what}: /generate with {n_prompts} prompts answered {str(doc)[:300]!r}; "
                             f"a batched request must answer one result per prompt")
        outputs = []
        for result in doc:
            meta = result.get("meta_info") if isinstance(result, dict) else None
            triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
            ids = result.get("output_ids") if isinstance(result, dict) else None
            if not isinstance(triples, list) or not isinstance(ids, list):
                raise StageError(f"{what}: no output_ids / meta_info.output_token_logprobs in "
                                 f"{str(result)[:300]!r}; {self.no_logprobs_hint}")
            try:
                lps = [None if t[0] is None else float(t[0]) for t in triples]
            except (TypeError, ValueError, IndexError) as exc:
                raise StageError(f"{what}: malformed output_token_logprobs {triples[:3]!r}...") from exc
            outputs.append(([int(t) for t in ids], lps))
        return outputs
