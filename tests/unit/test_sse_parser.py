"""The load generator's fast stream path: SSE decoding, each protocol's TokenStream, the keep-alive client."""

from __future__ import annotations

import asyncio
import math

import orjson
import pytest

from servegate.bench import protocol as proto
from servegate.bench.protocol import NATIVE, OPENAI
from servegate.bench.stats import ARRIVAL_KS_ALPHA, client_validity
from servegate.errors import ServerUnreachableError, StageError
from servegate.http import StreamingClient

pytestmark = pytest.mark.timeout(30)


def _feed_all(parts: list[bytes]) -> list[bytes]:
    dec = proto.SSEDecoder()
    out: list[bytes] = []
    for part in parts:
        out += dec.feed(part)
    return out + dec.close()


STREAM = b'data: {"a": 1}\n\ndata: {"a": 2}\n\n: keep-alive comment\n\nevent: x\ndata: {"a": 3}\n\ndata: [DONE]\n\n'
EXPECTED = [b'{"a": 1}', b'{"a": 2}', b'{"a": 3}', b"[DONE]"]


def test_one_event_per_read_is_the_fast_path() -> None:
    dec = proto.SSEDecoder()
    assert dec.feed(b'data: {"x":1}\n\n') == [b'{"x":1}']
    assert dec.feed(b"data: [DONE]\n\n") == [b"[DONE]"]
    assert dec.close() == []


def test_any_split_of_the_stream_gives_the_same_events() -> None:
    assert _feed_all([STREAM]) == EXPECTED
    for cut in range(1, len(STREAM)):
        assert _feed_all([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut
    assert _feed_all([bytes([b]) for b in STREAM]) == EXPECTED


def test_crlf_and_cr_line_ends_even_when_split_between_the_cr_and_the_lf() -> None:
    crlf = STREAM.replace(b"\n", b"\r\n")
    assert _feed_all([crlf]) == EXPECTED
    for cut in range(1, len(crlf)):
        assert _feed_all([crlf[:cut], crlf[cut:]]) == EXPECTED, cut
    assert _feed_all([STREAM.replace(b"\n", b"\r")]) == EXPECTED


def test_multi_line_data_no_space_and_an_unterminated_last_event() -> None:
    assert _feed_all([b"data: {\"a\":\ndata:  1}\n\n"]) == [b'{"a":\n 1}']
    assert _feed_all([b"data:[DONE]\n\n"]) == [b"[DONE]"]
    assert _feed_all([b'data: {"a": 1}\n\ndata: [DONE]\n']) == [b'{"a": 1}', b"[DONE]"]
    assert _feed_all([b"id: 4\nretry: 10\n\n"]) == []


def test_last_completion_tokens_reads_the_counter_without_decoding() -> None:
    chunk = orjson.dumps({"text": 'say "completion_tokens": 99', "output_ids": [5, 6, 7],
                          "meta_info": {"prompt_tokens": 12, "completion_tokens": 3}})
    assert proto.last_completion_tokens(chunk) == 3  # the key inside the text is escaped
    assert proto.last_completion_tokens(b'{"meta_info": {"completion_tokens" :4}}') is None  # not this spelling
    assert proto.last_completion_tokens(b'{"meta_info": {"completion_tokens": 17}}') == 17
    assert proto.last_completion_tokens(b'{"error": {"message": "boom"}}') is None


def test_parse_sse_payload() -> None:
    assert proto.parse_sse_payload(b"[DONE]") is proto.SSE_DONE
    assert proto.parse_sse_payload(b'{"a": 1}') == {"a": 1}
    with pytest.raises(StageError, match="not JSON"):
        proto.parse_sse_payload(b"{oops")
    with pytest.raises(StageError, match="not a JSON object"):
        proto.parse_sse_payload(b"[1]")


def _native(k: int, prompt: int = 9) -> bytes:
    return b"data: " + orjson.dumps({"text": "x" * k, "output_ids": list(range(k)),
                                     "meta_info": {"prompt_tokens": prompt, "completion_tokens": k}}) + b"\n\n"


def test_native_sink_counts_multi_token_chunks_and_keeps_only_times() -> None:
    sink = NATIVE.token_stream()
    assert not sink.feed(_native(1), 1.0)
    assert not sink.feed(_native(3) + _native(4), 2.0)  # speculative decoding: +2 then +1, one read
    assert sink.feed(b"data: [DONE]\n\n", 3.0)
    # Events read together are one arrival: the gap since the previous read spreads over their 3
    # tokens (ITL 1/3 each), never a zero gap between events of one read.
    assert sink.times == [1.0, 2.0] and sink.counts == [1, 4]
    assert sink.count == 4 and sink.done and sink.end_ts == 3.0
    assert orjson.loads(sink.last_payload)["meta_info"]["prompt_tokens"] == 9


def test_native_sink_error_chunk_is_a_stage_error() -> None:
    sink = NATIVE.token_stream()
    with pytest.raises(StageError, match="out of memory"):
        sink.feed(b'data: {"error": {"message": "out of memory"}}\n\n', 1.0)


def _openai(text: str, finish: str | None, usage: tuple[int, int] | None, choices: bool = True) -> bytes:
    obj: dict = {"choices": [{"index": 0, "text": text, "finish_reason": finish}] if choices else []}
    if usage:
        obj["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_openai_sink_counts_tokens_usage_and_skips_finish_only_chunks() -> None:
    sink = OPENAI.token_stream()
    sink.feed(_openai("a", None, (7, 1)), 1.0)
    sink.feed(_openai("", None, (7, 2)), 2.0)  # a token that decodes to nothing still counts
    sink.feed(_openai("", "length", None), 3.0)  # finish-only: no token
    sink.feed(_openai("", None, (7, 2), choices=False), 3.5)  # include_usage summary
    assert sink.feed(b"data: [DONE]\n\n", 4.0)
    assert sink.counts == [1, 2] and sink.times == [1.0, 2.0]
    assert sink.usage_total == 2 and sink.prompt_tokens == 7 and sink.final_prompt_tokens() == 7
    without_usage = OPENAI.token_stream()
    for i in range(3):
        without_usage.feed(_openai("t", None, None), float(i))
    assert without_usage.counts == [1, 2, 3]


def test_openai_sink_rejects_errors_and_malformed_chunks() -> None:
    with pytest.raises(StageError, match="rate limited"):
        OPENAI.token_stream().feed(b'data: {"error": {"message": "rate limited"}}\n\n', 1.0)
    with pytest.raises(StageError, match="malformed"):
        OPENAI.token_stream().feed(b'data: {"choices": [7]}\n\n', 1.0)


def test_client_validity() -> None:
    assert client_validity(False, math.nan) == {"arrival_fit_rejected": False, "client_valid": True}
    assert client_validity(False, ARRIVAL_KS_ALPHA / 2) == {"arrival_fit_rejected": True, "client_valid": False}
    assert client_validity(True, 0.5) == {"arrival_fit_rejected": False, "client_valid": False}


# --- StreamingClient against a real local server (asyncio.start_server on a free port) ---

class _Recorder:
    def __init__(self) -> None:
        self.data = b""
        self.done = False

    def feed(self, data: bytes, ts: float) -> bool:
        self.data += data
        self.done = self.done or b"[DONE]" in self.data
        return self.done


def _chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def _serve(handler) -> tuple[asyncio.AbstractServer, str, list[int]]:
    """A server that runs ``handler(request_bytes, writer, n)`` per request; counts connections."""
    connections: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                n += 1
                if not await handler(head + body, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def test_stream_split_across_writes_and_keep_alive_reuse() -> None:
    seen: list[bytes] = []

    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        seen.append(req)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        body = _chunked(b'data: {"a": 1}\n', b'\ndata: {"a": 2}\n\ndata: [DO', b"NE]\n\n")
        for i in range(0, len(body), 7):  # the client must reassemble arbitrary TCP segments
            writer.write(body[i:i + 7])
            await writer.drain()
        return True

    async def main() -> None:
        server, url, conns = await _serve(handler)
        async with server, StreamingClient(url, api_key="k") as client:
            for _ in range(3):
                rec = _Recorder()
                status, err, complete = await client.post_stream(client.request_bytes("/generate", b'{"q":1}'), rec)
                assert (status, err, complete) == (200, b"", True)
                assert rec.done and rec.data.count(b"data:") == 3
        assert len(conns) == 1  # one keep-alive connection for the three requests
        assert seen[0].startswith(b"POST /generate HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in seen[0]
        assert seen[0].endswith(b'Content-Length: 7\r\n\r\n{"q":1}')

    asyncio.run(main())


def test_http_chunks_read_together_are_one_arrival_never_a_zero_gap() -> None:
    # A chunked body calls the sink once per HTTP chunk; a busy client reads several chunks in one
    # read, so the sink sees several feeds with one timestamp. They are one arrival: a zero ITL gap
    # per extra chunk made a real vLLM block's median ITL 0 on a busy CI machine (log ratio NaN).
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (_openai("a", None, (3, i)) for i in (1, 2, 3))))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(_chunked(_openai("b", None, (3, 4)), _openai("c", "length", (3, 5)),
                              _openai("", None, (3, 5), choices=False), b"data: [DONE]\n\n"))
        return True

    async def main() -> None:
        server, url, _ = await _serve(handler)
        async with server, StreamingClient(url) as client:
            sink = OPENAI.token_stream()
            status, _, complete = await client.post_stream(client.request_bytes("/v1/completions", b"{}"), sink)
        assert (status, complete, sink.done, sink.count, sink.count_error(5)) == (200, True, True, 5, None)
        assert sink.counts[-1] == 5 and len(sink.times) == len(sink.counts) <= 5
        gaps = [b - a for a, b in zip(sink.times, sink.times[1:])]
        assert gaps and all(g > 0 for g in gaps), (sink.times, sink.counts)
        assert max(gaps) >= 0.04  # the pause between the two writes

    asyncio.run(main())


def test_feeds_with_one_timestamp_are_one_arrival_per_protocol() -> None:
    openai = OPENAI.token_stream()
    openai.feed(_openai("a", None, (3, 1)), 1.0)
    openai.feed(_openai("b", None, (3, 2)), 2.0)
    openai.feed(_openai("c", None, (3, 3)), 2.0)  # the next HTTP chunk of the same read
    assert openai.times == [1.0, 2.0] and openai.counts == [1, 3]
    native = NATIVE.token_stream()
    native.feed(_native(1), 1.0)
    native.feed(_native(2), 2.0)
    native.feed(_native(3), 2.0)
    native.feed(_native(4), 3.0)
    assert native.times == [1.0, 2.0, 3.0] and native.counts == [1, 3, 4]


def test_error_status_returns_its_body() -> None:
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b'HTTP/1.1 503 Service Unavailable\r\nContent-Length: 12\r\n\r\n{"busy": 1}\n')
        return True

    async def main() -> None:
        server, url, _ = await _serve(handler)
        async with server, StreamingClient(url) as client:
            rec = _Recorder()
            status, err, _ = await client.post_stream(client.request_bytes("/generate", b"{}"), rec)
            assert status == 503 and err == b'{"busy": 1}\n' and rec.data == b""

    asyncio.run(main())


def test_a_server_closing_its_idle_connection_is_retried_once() -> None:
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(b"data: [DONE]\n\n"))
        await writer.drain()
        return False  # close after each answer, without saying so (no Connection: close)

    async def main() -> None:
        server, url, conns = await _serve(handler)
        async with server, StreamingClient(url) as client:
            for _ in range(2):
                rec = _Recorder()
                status, _, _ = await client.post_stream(client.request_bytes("/generate", b"{}"), rec)
                assert status == 200 and rec.done
        assert len(conns) == 2

    asyncio.run(main())


def test_connection_cut_mid_stream_and_refused_connection_are_unreachable() -> None:
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b'f\r\ndata: {"a":1}\n\n\r\n')
        await writer.drain()
        return False  # the worker died mid-stream

    async def main() -> None:
        server, url, _ = await _serve(handler)
        async with server, StreamingClient(url) as client:
            with pytest.raises(ServerUnreachableError, match="closed the connection mid-request"):
                await client.post_stream(client.request_bytes("/generate", b"{}"), _Recorder())
        port = int(url.rsplit(":", 1)[1])
        async with StreamingClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(ServerUnreachableError, match="cannot connect"):
                await client.post_stream(client.request_bytes("/generate", b"{}"), _Recorder())

    asyncio.run(main())


def test_not_http_is_a_stage_error_and_a_bad_url_is_refused() -> None:
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        return True

    async def main() -> None:
        server, url, _ = await _serve(handler)
        async with server, StreamingClient(url) as client:
            with pytest.raises(StageError, match="malformed HTTP response"):
                await client.post_stream(client.request_bytes("/generate", b"{}"), _Recorder())

    asyncio.run(main())
    with pytest.raises(StageError, match="http"):
        StreamingClient("unix:///tmp/sock")


def test_error_answer_ended_by_closing_the_connection_keeps_its_status() -> None:
    async def handler(req: bytes, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n\r\nboom")
        await writer.drain()
        return False

    async def main() -> None:
        server, url, _ = await _serve(handler)
        async with server, StreamingClient(url) as client:
            status, err, complete = await client.post_stream(client.request_bytes("/generate", b"{}"), _Recorder())
            assert (status, err, complete) == (500, b"boom", False)

    asyncio.run(main())


@pytest.mark.parametrize("dumps", [orjson.dumps, lambda o: __import__("json").dumps(o).encode()],
                         ids=["compact", "spaced"])
def test_openai_fast_and_slow_paths_agree(dumps) -> None:
    """Compact chunks take the bytes-level path, spaced ones the orjson path: same counts."""
    sink = OPENAI.token_stream()
    chunks = [{"choices": [{"index": 0, "text": 'a "finish_reason":null', "finish_reason": None}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 1}},
              {"choices": [{"index": 0, "text": "b", "finish_reason": None}],
               "usage": {"prompt_tokens": 5, "completion_tokens": 3}},  # two tokens in one chunk
              {"choices": [{"index": 0, "text": "", "finish_reason": None}]},  # no usage: one more
              {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}]
    for i, c in enumerate(chunks):
        sink.feed(b"data: " + dumps(c) + b"\n\n", float(i))
    assert sink.counts == [1, 3, 4] and sink.times == [0.0, 1.0, 2.0]


# --- issue 11: server token counts are checked against what was streamed ---------------------

def test_native_output_id_count_reads_the_ids_without_decoding() -> None:
    assert proto.native_output_id_count(orjson.dumps({"text": "a", "output_ids": [5, 6, 7],
                                                      "meta_info": {"completion_tokens": 3}})) == 3
    assert proto.native_output_id_count(b'{"output_ids": [ 5 ,6 ], "meta_info": {}}') == 2  # spaced JSON
    assert proto.native_output_id_count(b'{"output_ids":[],"meta_info":{}}') == 0
    assert proto.native_output_id_count(b'{"output_ids": [ ], "meta_info": {}}') == 0
    assert proto.native_output_id_count(b'{"text": "say \\"output_ids\\": [1]", "meta_info": {}}') is None
    assert proto.native_output_id_count(b'{"output_ids": null}') is None


def _check(chunks: list[tuple[int, int | None]]) -> proto.NativeCountCheck:
    check = proto.NativeCountCheck()
    for count, n_ids in chunks:
        check.chunk(count, n_ids)
    return check


def test_native_count_check_accepts_cumulative_and_incremental_ids_and_multi_token_chunks() -> None:
    cumulative = _check([(1, 1), (3, 3), (4, 4)])  # SGLang's default; a chunk of 2 tokens
    assert not cumulative.wants_ids  # outgrown by its second chunk: only the last one matters now
    cumulative.finish(4, 4)
    incremental = _check([(1, 1), (3, 2), (4, 1), (4, 0)])  # --stream-output; a finish-only chunk
    assert incremental.wants_ids
    incremental.finish(4, 0)
    _check([(5, 5)]).finish(5, 5)  # one chunk: both readings agree
    _check([(1, None), (9, 3)]).finish(9, None)  # a server without output_ids: nothing to hold it to


def test_native_count_check_tolerates_a_count_one_ahead_mid_stream() -> None:
    # The embedded worker may render a chunk while its engine appends a token: the count runs
    # one ahead of the ids in that chunk, and the final, finished chunk agrees again.
    _check([(1, 1), (3, 2), (3, 3), (4, 4)]).finish(4, 4)


@pytest.mark.parametrize("chunks,final,match", [
    # x15 from the start, 6 tokens: the ids summed (21) are not the count either
    ([(15 * k, k) for k in range(1, 7)], 6, r"reported 90 completion tokens but its output ids add up to neither "
                                            r"\(6 in its last chunk, .* 21 summed"),
    # cumulative, then a last chunk claiming more than its ids
    ([(1, 1), (2, 2), (64, 3)], 3, "reported 64 completion tokens but its last chunk carries 3 output ids"),
    # incremental ids that fall short of the count
    ([(1, 1), (3, 1), (5, 1)], 1, r"reported 5 completion tokens but .* 3 summed over its chunks"),
])
def test_native_count_check_rejects_counts_that_disagree_with_the_ids(chunks, final, match) -> None:
    check = _check(chunks)
    with pytest.raises(StageError, match=match):
        check.finish(chunks[-1][0], final)


def test_native_count_check_rejects_a_count_that_goes_down() -> None:
    with pytest.raises(StageError, match="went down from 3 to 2"):
        _check([(1, 1), (3, 3), (2, 2)])


def test_check_count_within() -> None:
    proto.check_count_within(8, 8)
    with pytest.raises(StageError, match="reported 9 completion tokens for the request, which asked for at most 8"):
        proto.check_count_within(9, 8)


def test_token_stream_count_error_per_protocol() -> None:
    native = NATIVE.token_stream()
    native.feed(_native(1) + _native(2) + _native(3), 1.0)
    assert native.count_error(3) is None
    assert "asked for at most 2" in native.count_error(2)
    liar = NATIVE.token_stream()
    liar.feed(_native(1) + _native(2), 1.0)  # cumulative from here on: only the last chunk is read
    liar.feed(b"data: " + orjson.dumps({"text": "xxx", "output_ids": [0, 1, 2],
                                        "meta_info": {"completion_tokens": 30}}) + b"\n\n", 2.0)
    assert "reported 30 completion tokens but its last chunk carries 3 output ids" in liar.count_error(64)

    honest = OPENAI.token_stream()
    for i in range(1, 4):
        honest.feed(_openai("t", None, (5, i)), float(i))
    honest.feed(_openai("", None, (5, 3), choices=False), 4.0)
    assert honest.count_error(3) is None
    contradicts = OPENAI.token_stream()
    for i in range(1, 4):
        contradicts.feed(_openai("t", None, (5, i)), float(i))
    contradicts.feed(_openai("", None, (5, 40), choices=False), 4.0)
    assert "final usage says 40 completion tokens but its per-chunk usage reached 3" in contradicts.count_error(64)
    # vLLM with continuous usage: the last token decodes to nothing (a character's bytes held back), so
    # its finish chunk has empty text but per-chunk usage one higher; then the usage chunk agrees.
    empty_last = OPENAI.token_stream()
    for i in range(1, 4):
        empty_last.feed(_openai("t", None, (5, i)), float(i))
    empty_last.feed(_openai("", "length", (5, 4)), 4.0)
    empty_last.feed(_openai("", None, (5, 4), choices=False), 4.5)
    assert empty_last.count_error(4) is None
    assert empty_last.counts == [1, 2, 3, 4] and empty_last.times == [1.0, 2.0, 3.0, 4.0]
    grouped = OPENAI.token_stream()  # no per-chunk usage: chunks may group tokens, the total decides
    grouped.feed(_openai("tt", None, None), 1.0)
    grouped.feed(_openai("", None, (5, 4), choices=False), 2.0)
    assert grouped.count_error(4) is None
    assert "reported 4 completion tokens" in grouped.count_error(3)
