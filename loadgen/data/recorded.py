"""Replay traffic the router recorded (``router.traffic_record``): ``python -m loadgen
--trace recorded --trace-file FILE``.

Each recorded request comes back at its own offset, with its prompt and output
lengths, and with the same prefix sharing: every distinct salted block hash becomes a
fixed run of token ids, so two requests that shared their first k blocks when they
were recorded share their first k blocks of tokens again, and the server's prefix cache
sees the traffic it saw. Nothing in a record says what the prompts were; the replayed
prompts are random tokens (on ``/v1/completions``: chat text cannot pin token ids).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadgen.config import WORKLOADS, WorkloadConfig
from loadgen.data.workloads import LengthDraws, RequestSize, WorkloadPlan

RECORDED_WORKLOAD = "recorded-replay"
SUPPORTED_VERSION = 1


class RecordError(ValueError):
    """A file that is not a traffic record we can replay."""


@dataclass(frozen=True)
class RecordedTraffic:
    block_tokens: int
    arrivals: list[float]  # seconds from the first request
    sizes: list[RequestSize]


def read_record(path: Path) -> RecordedTraffic:
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        raise RecordError(f"{path}: not a traffic record ({error})") from None
    if not lines or "header" not in lines[0]:
        raise RecordError(f"{path}: no header line; record it with router.traffic_record")
    header = lines[0]["header"]
    if header.get("version") != SUPPORTED_VERSION:
        raise RecordError(
            f"{path}: record version {header.get('version')}, not {SUPPORTED_VERSION}"
        )
    rows = [row for row in lines[1:] if "header" not in row]  # a restarted router appends
    if not rows:
        raise RecordError(f"{path}: the record holds no request")
    rows.sort(key=lambda row: row["t"])
    start = rows[0]["t"]
    return RecordedTraffic(
        block_tokens=int(header["block_tokens"]),
        arrivals=[row["t"] - start for row in rows],
        sizes=[
            RequestSize(int(row["in"]), max(1, int(row["out"])), tuple(row["prefix"]))
            for row in rows
        ],
    )


class RecordedReplay:
    """The record in its own order and at its own offsets (``--time-scale`` applies)."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        if config.trace_file is None:
            raise RecordError("--trace recorded needs --trace-file, the router's record")
        record = read_record(config.trace_file)
        count = min(draws.num_requests, len(record.sizes))
        too_long = [
            s for s in record.sizes[:count] if s.input_len + s.output_len > draws.max_model_len
        ]
        if too_long:
            raise RecordError(
                f"{len(too_long)} recorded requests exceed the server's context of"
                f" {draws.max_model_len} tokens"
            )
        sizes = record.sizes[:count]
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=sizes,
            warmup_sizes=[
                RequestSize(s.input_len, s.output_len) for s in sizes[: draws.warmup_requests]
            ],
            source=str(config.trace_file),
            trace_arrivals=record.arrivals[:count],
            prefix_block_tokens=record.block_tokens,
        )


WORKLOADS.register(RECORDED_WORKLOAD)(RecordedReplay())


class PrefixedPrompts:
    """Token prompts whose recorded prefix blocks become the same tokens every time."""

    def __init__(self, seed: int, block_tokens: int, low: int, high: int) -> None:
        self._seed = seed
        self._block_tokens = block_tokens
        self._low, self._high = low, high
        self._blocks: dict[str, list[int]] = {}
        self._tails = random.Random(seed)

    def prompt(self, size: RequestSize) -> list[int]:
        tokens: list[int] = []
        for block in size.prefix:
            tokens += self._block(block)
        tail = max(0, size.input_len - len(tokens))
        tokens += [self._tails.randrange(self._low, self._high) for _ in range(tail)]
        return tokens[: size.input_len]

    def _block(self, block_hash: str) -> list[int]:
        if block_hash not in self._blocks:
            rng = random.Random(f"{self._seed}:{block_hash}")
            self._blocks[block_hash] = [
                rng.randrange(self._low, self._high) for _ in range(self._block_tokens)
            ]
        return self._blocks[block_hash]
