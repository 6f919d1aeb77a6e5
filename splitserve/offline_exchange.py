"""What the load generator and the offline simulation exchange, as typed JSON lines.

``python -m loadgen simulate`` (loadgen/study/simulate.py) writes each request it would
send as an ``Arrival``; ``python -m deployments.simulate`` serves them on simulated
engines in virtual time and writes what a client would have seen of each as an
``Outcome``. A search over layouts and rates talks to one simulation worker through a
``Job`` a line and its ``Answer``. The load generator imports nothing of the server,
so the structs live here, beside both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from splitserve.priorities import Priority


class Arrival(msgspec.Struct, frozen=True):
    """One request as the load generator sends it: its index, arrival offset (seconds
    from the run's start), prompt token ids, output length and priority (None: the
    router's default)."""

    index: int
    at: float
    prompt: list[int]
    max_tokens: int
    priority: Priority | None = None


class Outcome(msgspec.Struct):
    """What a client saw of one request: its status, token times (virtual seconds from
    the run's start) and where the router said it ran (``headers``: x-splitserve-*)."""

    index: int
    arrival_s: float
    status: int = 200
    outcome: Literal["ok", "rejected", "error"] = "ok"
    error: str | None = None
    token_times: list[float] = []
    prompt_tokens: int = 0
    # Where its prompt was computed, as planned: "where:reason".
    prefill: str | None = None
    headers: dict[str, str] = {}


class Description(msgspec.Struct, frozen=True):
    """What a client would learn of a simulated application: GET /v1/models' model
    and context, and the router's shape."""

    model: str
    max_model_len: int
    shape: str


class Job(msgspec.Struct, frozen=True):
    """One run for a simulation worker: a config on a profile, the requests file and
    where its outcomes go; ``at``: arrival offsets replacing the file's, for its first
    requests in order (the same prompts at another rate)."""

    config: str
    profile: str
    requests: str
    out: str
    model: str | None = None
    path_ms: float = 0.0
    at: list[float] | None = None


class RunSpeed(msgspec.Struct, frozen=True):
    """How an offline run went: virtual and wall seconds, each engine's busy share."""

    utilization_pct: dict[str, float]
    requests: int
    engines: int
    virtual_s: float
    wall_s: float
    speedup: float | None
    events: int


class Answer(msgspec.Struct, frozen=True):
    """A worker's answer to one job: the run's speed, or why it could not run."""

    speed: RunSpeed | None = None
    error: str | None = None


Line = TypeVar("Line", bound=msgspec.Struct)
_ENCODER = msgspec.json.Encoder()


def encode(item: msgspec.Struct) -> str:
    return _ENCODER.encode(item).decode()


def decode(line: str | bytes, kind: type[Line]) -> Line:
    """One line as ``kind``; a line that is not one raises ``msgspec.ValidationError``
    (a ``ValueError``) naming the field."""
    return msgspec.json.decode(line, type=kind)


def write_lines(path: Path, items: Iterable[msgspec.Struct]) -> None:
    with path.open("wb") as out:
        for item in items:
            out.write(_ENCODER.encode(item) + b"\n")


def read_lines(path: Path, kind: type[Line]) -> Iterator[Line]:
    decoder = msgspec.json.Decoder(kind)
    with path.open("rb") as lines:
        for line in lines:
            if line.strip():
                yield decoder.decode(line)
