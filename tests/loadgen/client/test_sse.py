"""Reading SSE streams back into timed tokens: token ids, plain chunks, usage, errors."""

from __future__ import annotations

import json

from loadgen.client.sse import read_stream


def _event(payload: dict[str, object]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _chunk(ids: list[int], chat: bool = False) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": "x" * len(ids)}, "token_ids": ids}
    else:
        choice = {"index": 0, "text": "x" * len(ids), "token_ids": ids}
    return _event({"choices": [choice]})


USAGE = _event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5}})
DONE = b"data: [DONE]\n\n"


def test_token_ids_counted_per_read() -> None:
    reads = [
        (1.0, _chunk([1])),
        (1.1, _chunk([2, 3]) + _chunk([4])),  # two events in one read: one timestamp
        (1.2, _chunk([5]) + USAGE + DONE),
    ]
    reading = read_stream(reads)
    assert reading.chunk_times == [1.0, 1.1, 1.2]
    assert reading.chunk_tokens == [1, 3, 1]
    assert (reading.prompt_tokens, reading.completion_tokens, reading.finished) == (12, 5, True)
    assert reading.error is None


def test_prompt_token_ids_are_not_output_tokens() -> None:
    first = _event(
        {"choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2, 3]}]}
    )
    assert read_stream([(1.0, first)]).chunk_tokens == [1]


def test_event_split_across_reads_belongs_to_the_read_that_completes_it() -> None:
    whole = _chunk([1, 2])
    reads = [(1.0, whole[:10]), (1.5, whole[10:] + _chunk([3])[:5]), (2.0, _chunk([3])[5:])]
    reading = read_stream(reads)
    assert reading.chunk_times == [1.5, 2.0]
    assert reading.chunk_tokens == [2, 1]


def test_chat_role_opener_is_not_a_token() -> None:
    opener = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    reading = read_stream([(1.0, opener), (1.2, _chunk([9], chat=True)), (1.3, USAGE + DONE)])
    assert reading.chunk_times == [1.2] and reading.chunk_tokens == [1]


def test_without_token_ids_one_token_per_content_chunk() -> None:
    opener = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    chunk = _event({"choices": [{"index": 0, "delta": {"content": "ab"}}]})
    text = _event({"choices": [{"index": 0, "text": ""}]})  # empty text still a token
    reading = read_stream([(1.0, opener + chunk), (1.1, chunk + chunk), (1.2, text + DONE)])
    assert reading.chunk_tokens == [1, 2, 1]


def test_crlf_line_endings_and_comments() -> None:
    body = b": keep-alive\r\n\r\n" + _chunk([1, 2]).replace(b"\n", b"\r\n") + DONE
    reading = read_stream([(1.0, body)])
    assert reading.chunk_tokens == [2] and reading.finished


def test_error_event_is_reported() -> None:
    error = _event({"error": {"message": "the engine replica engine-0 failed", "code": 500}})
    reading = read_stream([(1.0, _chunk([1])), (1.1, error + DONE)])
    assert reading.error == "the engine replica engine-0 failed"
    assert reading.chunk_tokens == [1]


def test_usage_null_in_every_chunk_is_ignored() -> None:
    chunk = _event({"choices": [{"index": 0, "text": "a", "token_ids": [1]}], "usage": None})
    reading = read_stream([(1.0, chunk), (1.1, USAGE)])
    assert reading.completion_tokens == 5


def test_chunks_counted_as_vllms_client_counts_them() -> None:
    """Every event with choices is one chunk (the opener and a finish-only event too);
    the usage event is not; a chunk of three tokens is one chunk."""
    opener = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    finish = _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    reads = [
        (1.0, opener),
        (1.2, _chunk([1, 2, 3], chat=True)),
        (1.3, _chunk([4], chat=True) + finish),
        (1.4, USAGE + DONE),
    ]
    reading = read_stream(reads)
    assert (reading.event_times, reading.event_counts) == ([1.0, 1.2, 1.3], [1, 1, 2])
    assert (reading.chunk_times, reading.chunk_tokens) == ([1.2, 1.3], [3, 1])
    text = b'data: {"choices": [{"text": "\\"choices\\": [{"}]}\n\n'  # quoted in the text
    assert read_stream([(1.0, text)]).event_counts == [1]
