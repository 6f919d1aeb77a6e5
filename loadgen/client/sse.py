"""Read an OpenAI server-sent-event stream back into token timings.

The client stores each network read with the ``perf_counter`` of its arrival; this
module turns those reads into (arrival time, tokens) pairs plus the final usage and
any error event. An event belongs to the read in which its closing blank line
arrived, which is when the client could have shown it.

Counting tokens: when the server sends vLLM's ``token_ids`` (we ask for them), a
chunk's tokens are the ids it carries, counted with one regular expression over the
whole read instead of one JSON parse per event. Servers without them fall back to
one JSON parse per event and one token per content-bearing chunk.

Counting chunks, as vLLM's benchmark client does: every event whose ``choices`` list is
not empty is one chunk, whatever it carries (the chat stream's opening role
announcement and a last chunk with only a finish reason included). Those reads are kept
apart (``event_times``/``event_counts``) so that vLLM's figures (one ITL gap per chunk,
``loadgen.vllm_compat.result``) can be written beside ours (one gap per token).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

EVENT_END = b"\n\n"
DATA_PREFIX = b"data:"
DONE = b"[DONE]"
TOKEN_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')
USAGE_OBJECT = re.compile(rb'"usage":\s*\{')
ERROR_OBJECT = re.compile(rb'"error":\s*\{')
# A non-empty choices list. Generated text cannot fake it: quotes inside JSON strings
# are escaped, so `"choices":` never matches there.
CHOICES_EVENT = re.compile(rb'"choices":\s*\[\s*\{')


@dataclass
class StreamReading:
    """What one streamed response said, timed per read."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # Reads that carried events with non-empty ``choices``, and how many each.
    event_times: list[float] = field(default_factory=list)
    event_counts: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    finished: bool = False  # saw [DONE]

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


def read_stream(reads: list[tuple[float, bytes]]) -> StreamReading:
    """Token timings, usage and errors of a whole SSE body given as timed reads."""
    with_ids = any(b'"token_ids"' in data for _, data in reads) or (
        b'"token_ids"' in b"".join(data for _, data in reads)  # split across two reads
    )
    reading = StreamReading()
    carry = b""
    for timestamp, data in reads:
        block = carry + data if carry else data
        if b"\r" in block:
            block = block.replace(b"\r\n", b"\n")
        cut = block.rfind(EVENT_END)
        if cut < 0:
            carry = block
            continue
        complete, carry = block[: cut + 2], block[cut + 2 :]
        tokens = _count_with_ids(complete) if with_ids else _count_by_events(complete)
        if tokens:
            reading.chunk_times.append(timestamp)
            reading.chunk_tokens.append(tokens)
        if events := len(CHOICES_EVENT.findall(complete)):
            reading.event_times.append(timestamp)
            reading.event_counts.append(events)
        _read_special_events(complete, reading)
    return reading


def _count_with_ids(block: bytes) -> int:
    arrays = TOKEN_IDS.findall(block)
    if not arrays:
        return 0
    # Each non-empty array holds (commas + 1) ids; joining keeps the comma count exact.
    return b"".join(arrays).count(b",") + len(arrays) - arrays.count(b"")


def _count_by_events(block: bytes) -> int:
    tokens = 0
    for event in _data_events(block):
        choices = event.get("choices") if isinstance(event, dict) else None
        if choices and _carries_token(choices[0]):
            tokens += 1
    return tokens


def _carries_token(choice: dict[str, Any]) -> bool:
    if "text" in choice:
        return True
    delta = choice.get("delta") or {}
    if "role" in delta and not delta.get("content"):
        return False  # the chat stream's opening role announcement
    return "content" in delta or "reasoning_content" in delta


def _read_special_events(block: bytes, reading: StreamReading) -> None:
    if DONE in block:
        reading.finished = True
    for event in _events_matching(block, (USAGE_OBJECT, ERROR_OBJECT)):
        if isinstance(usage := event.get("usage"), dict):
            reading.prompt_tokens = usage.get("prompt_tokens", reading.prompt_tokens)
            reading.completion_tokens = usage.get("completion_tokens", reading.completion_tokens)
        if isinstance(error := event.get("error"), dict):
            reading.error = str(error.get("message") or error)


def _events_matching(block: bytes, patterns: tuple[re.Pattern[bytes], ...]) -> list[dict[str, Any]]:
    """Parse only the events that contain a pattern (the usage event, error events)."""
    spans = set()
    for pattern in patterns:
        for match in pattern.finditer(block):
            start = block.rfind(EVENT_END, 0, match.start())
            end = block.find(EVENT_END, match.end())
            spans.add((0 if start < 0 else start + 2, len(block) if end < 0 else end + 2))
    events: list[dict[str, Any]] = []
    for start, end in sorted(spans):
        events.extend(e for e in _data_events(block[start:end]) if isinstance(e, dict))
    return events


def _data_events(block: bytes) -> list[Any]:
    events = []
    for raw in block.split(EVENT_END):
        payload = b"".join(
            line[len(DATA_PREFIX) :].lstrip(b" ")
            for line in raw.split(b"\n")
            if line.startswith(DATA_PREFIX)
        )
        if not payload or payload == DONE:
            continue
        try:
            events.append(json.loads(payload))
        except ValueError:
            continue  # not JSON: a comment or keep-alive the server chose to send
    return events
