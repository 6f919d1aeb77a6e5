"""Per-request figures and the run summary, always from every sample.

Definitions (times relative to the moment the request was handed to the connection):

- TTFT: arrival of the first read that carried a token.
- ITL: every gap between consecutive tokens. A chunk that carries ``n`` tokens after
  a gap ``g`` contributes ``n`` gaps of ``g / n``: the client cannot see when each
  was made, and spreading keeps both the count (tokens - 1) and the sum (last token
  minus first) exact. Extra tokens in the first chunk contribute gaps of 0.
- TPOT: (last token - first token) / (tokens - 1); undefined for one token.
- E2E: end of the response stream.
- Send lag: actual send time minus scheduled send time (at QPS inf with
  ``--max-concurrency``, the wait for a free slot).
- Chunks (``ChunkTimes``): the same request as vLLM's benchmark client sees it, for
  ``loadgen.vllm_compat.result``: TTFT at the first event with choices, one ITL gap per such
  event (not per token), latency at the last one.

Percentiles are numpy's linear interpolation over all samples of the run: every
request's TTFT, every gap of every request for ITL. Never averages of averages.
Throughputs divide by the run's duration, from its first scheduled send to its last
completion; token counts are those of completed requests, as the server reported
them in ``usage`` (the client's own count when it did not).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from loadgen.client.streaming import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class ChunkTimes:
    """A completed request in vLLM's benchmark client's terms, seconds from the send.

    Events that arrived in one network read are one read apart by 0 s: vLLM's client
    times each of them separately, microseconds apart, which this client cannot see.
    """

    ttft_s: float
    itl_s: tuple[float, ...]  # one gap per chunk after the first
    latency_s: float  # arrival of the last chunk (the usage event and [DONE] not waited for)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """One request's figures, seconds; offsets are from the run's start."""

    index: int
    warmup: bool
    outcome: str
    status: str
    error: str | None
    scheduled_s: float
    sent_s: float
    done_s: float
    send_lag_s: float
    input_len: int
    output_len: int
    prompt_tokens: int | None
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    itl_s: tuple[float, ...]
    chunks: ChunkTimes | None = None  # completed requests only
    prefill: str | None = None  # a splitserve router's x-splitserve-prefill: where, why

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.input_len

    @property
    def length_mismatch(self) -> bool:
        # input_len 0: a dataset's text prompt, whose length only the server knows.
        prompt_off = (
            self.input_len > 0
            and self.prompt_tokens is not None
            and self.prompt_tokens != self.input_len
        )
        return prompt_off or self.output_tokens != self.output_len

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["itl_s"] = list(self.itl_s)
        del record["chunks"]  # the per-token figures are ours; vLLM's go to .vllm.json
        return record


def token_gaps(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Every inter-token gap, token-accurate for chunks that carry several tokens."""
    gaps: list[float] = []
    if not chunk_times:
        return gaps
    gaps.extend([0.0] * (chunk_tokens[0] - 1))
    for index in range(1, len(chunk_times)):
        tokens = chunk_tokens[index]
        share = (chunk_times[index] - chunk_times[index - 1]) / tokens
        gaps.extend([share] * tokens)
    return gaps


def chunk_times(record: RequestRecord) -> ChunkTimes | None:
    """vLLM's view of a record: one gap per chunk, 0 s between chunks of one read."""
    times, counts = record.event_times, record.event_counts
    if not times:
        return None
    gaps: list[float] = [0.0] * (counts[0] - 1)
    for index in range(1, len(times)):
        gaps.append(times[index] - times[index - 1])
        gaps.extend([0.0] * (counts[index] - 1))
    return ChunkTimes(times[0] - record.sent_at, tuple(gaps), times[-1] - record.sent_at)


def request_metrics(record: RequestRecord, run_start: float) -> RequestMetrics:
    """A finished record's figures; latencies only for completed requests."""
    ok = record.outcome == "ok"
    tokens = sum(record.chunk_tokens)
    output_tokens = record.completion_tokens if record.completion_tokens is not None else tokens
    ttft = tpot = e2e = None
    gaps: list[float] = []
    if ok:
        ttft = record.chunk_times[0] - record.sent_at
        e2e = record.done_at - record.sent_at
        gaps = token_gaps(record.chunk_times, record.chunk_tokens)
        if tokens > 1:
            tpot = (record.chunk_times[-1] - record.chunk_times[0]) / (tokens - 1)
    return RequestMetrics(
        index=record.index,
        warmup=record.warmup,
        outcome=record.outcome,
        status="200" if ok else record.status_key,
        error=record.error,
        scheduled_s=record.scheduled_at - run_start,
        sent_s=record.sent_at - run_start,
        done_s=record.done_at - run_start,
        send_lag_s=record.sent_at - record.scheduled_at,
        input_len=record.input_len,
        output_len=record.output_len,
        prompt_tokens=record.prompt_tokens,
        output_tokens=output_tokens if ok else 0,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        itl_s=tuple(gaps),
        chunks=chunk_times(record) if ok else None,
        prefill=record.prefill,
    )


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """numpy's linear-interpolation percentile; NaN for no samples."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency, seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        array = np.fromiter(values, dtype=float)
        if array.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p95, p99 = np.percentile(array, PERCENTILES).tolist()
        return cls(int(array.size), float(array.mean()), p50, p90, p95, p99)

    def ms(self) -> dict[str, float]:
        return {name: getattr(self, name) * 1000 for name in ("mean", "p50", "p90", "p95", "p99")}


@dataclass(frozen=True)
class ServiceLevel:
    """Goodput's targets, seconds; a target left None is not checked."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def defined(self) -> bool:
        return any(t is not None for t in (self.ttft_s, self.tpot_s, self.e2e_s))

    def met_by(self, metrics: RequestMetrics) -> bool:
        if metrics.outcome != "ok" or metrics.ttft_s is None:
            return False
        if self.ttft_s is not None and metrics.ttft_s > self.ttft_s:
            return False
        if self.e2e_s is not None and (metrics.e2e_s is None or metrics.e2e_s > self.e2e_s):
            return False
        # A one-token answer has no TPOT and cannot miss a TPOT target.
        return self.tpot_s is None or metrics.tpot_s is None or metrics.tpot_s <= self.tpot_s


@dataclass(frozen=True)
class RunSummary:
    """A run's figures, from its measured (non-warm-up) requests."""

    requests: int
    completed: int
    rejected: int
    errors: int
    failures_by_status: dict[str, int]
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    input_tokens: int
    output_tokens: int
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    send_lag: Distribution
    goodput: float | None
    slo_attainment: float | None
    length_mismatches: int
    service_level: ServiceLevel = field(default_factory=ServiceLevel)


def summarize_run(
    metrics: Sequence[RequestMetrics],
    duration_s: float,
    service_level: ServiceLevel | None = None,
) -> RunSummary:
    """The run's throughputs, latency distributions and goodput; warm-ups left out."""
    measured = [m for m in metrics if not m.warmup]
    done = [m for m in measured if m.outcome == "ok"]
    service_level = service_level or ServiceLevel()
    input_tokens = sum(m.input_tokens for m in done)
    output_tokens = sum(m.output_tokens for m in done)
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(service_level.met_by(m) for m in measured) if service_level.defined else None
    return RunSummary(
        requests=len(measured),
        completed=len(done),
        rejected=sum(m.outcome == "rejected" for m in measured),
        errors=sum(m.outcome == "error" for m in measured),
        failures_by_status=dict(Counter(m.status for m in measured if m.outcome != "ok")),
        duration_s=duration_s,
        request_throughput=len(done) * per_second,
        output_token_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        ttft=Distribution.of(m.ttft_s for m in done if m.ttft_s is not None),
        itl=Distribution.of(gap for m in done for gap in m.itl_s),
        tpot=Distribution.of(m.tpot_s for m in done if m.tpot_s is not None),
        e2e=Distribution.of(m.e2e_s for m in done if m.e2e_s is not None),
        send_lag=Distribution.of(m.send_lag_s for m in measured if math.isfinite(m.send_lag_s)),
        goodput=None if good is None else good * per_second,
        slo_attainment=None if good is None or not measured else good / len(measured),
        length_mismatches=sum(m.length_mismatch for m in done),
        service_level=service_level,
    )


def run_duration(metrics: Sequence[RequestMetrics]) -> float:
    """From the run's start (offset 0, the first scheduled send) to its last answer."""
    ends = [m.done_s for m in metrics if not m.warmup and math.isfinite(m.done_s)]
    return max(ends, default=0.0)
