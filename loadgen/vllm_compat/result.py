"""A run as ``vllm bench serve --save-result`` writes it (vLLM 0.32's serve.py: the dict of
``benchmark()`` plus what ``main_async`` adds), key for key and with vLLM's meaning:

- Per request (``--save-detailed``): ``input_lens`` (the server's prompt count),
  ``output_lens`` (0 for a failure), ``ttfts``, ``itls``, ``latencies``, ``start_times``
  (``perf_counter`` seconds, as vLLM's), ``queue_times`` (wait before the send),
  ``generated_texts`` (empty: we keep token counts, not text), ``errors``.
- vLLM's unit is the chunk, not the token: TTFT is the first event with choices, each
  later event is one ITL gap (a chunk of n tokens is one gap, not n), the latency ends at
  the last such event, TPOT is (latency - TTFT) / (output tokens - 1). Our per-token
  gaps are kept as ``splitserve_itls_per_token`` and ``splitserve_*_itl_per_token_ms``.
- ``max_output_tokens_per_s`` and ``max_concurrent_requests`` count chunks and requests
  in whole-second buckets, as vLLM does; ``rtfx`` is 0 (no audio); ``request_goodput``
  is None without an SLO, else the requests meeting every one of ``--goodput``'s
  (``--slo-ttft-ms`` ...) per second, with vLLM's TPOT and latency.
- ``mean_/median_/std_/p<N>_<metric>_ms`` for the chosen metrics and percentiles.

``<run>.vllm.json`` is written for every run as ``--save-detailed --percentile-metrics
ttft,tpot,itl,e2el --metric-percentiles 50,90,95,99`` would write it (flags given win)
and is labelled with the serving shape; ``--save-result`` writes vLLM's own file
(``save_vllm_result``) with vLLM's defaults. Only measured requests count.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.outputs.stats import RequestMetrics
from loadgen.scheduling.arrivals import ramp_up_rates
from loadgen.scheduling.runner import RunResult

BACKEND_OF_ENDPOINT = {"completions": "openai", "chat": "openai-chat"}
# What --percentile-metrics may name, in the order vLLM writes them.
PERCENTILE_METRICS = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "client_queue_time",
    "e2el_including_client_queue",
)
VLLM_DEFAULT_METRICS = ("ttft", "tpot", "itl")
VLLM_DEFAULT_PERCENTILES = (99.0,)
# vLLM drops these unless --save-detailed (latencies and queue_times stay).
DETAILED_KEYS = (
    "input_lens",
    "output_lens",
    "start_times",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    "splitserve_itls_per_token",
)
MS = 1000.0


@dataclass(frozen=True)
class VllmResultOptions:
    """What ``vllm bench serve``'s flags say about its result file."""

    backend: str | None = None  # --backend; default from the endpoint
    label: str | None = None  # --label
    model_id: str | None = None  # --model; default the card's root, else the model
    tokenizer_id: str | None = None  # --tokenizer; default model_id
    num_prompts: int | None = None  # --num-prompts; default the run's request count
    metadata: dict[str, str] = field(default_factory=dict)  # --metadata KEY=VALUE
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
    percentiles: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)
    detailed: bool = True  # --save-detailed


@dataclass(frozen=True)
class _Request:
    """One measured request as vLLM's ``RequestFuncOutput`` holds it."""

    success: bool
    prompt_len: int
    output_len: int
    ttft: float
    itl: list[float]
    latency: float
    start_time: float
    queue_time: float
    error: str
    itl_per_token: list[float]


def _as_vllm(metrics: RequestMetrics, clock_origin_s: float) -> _Request:
    chunks = metrics.chunks
    success = metrics.outcome == "ok" and chunks is not None
    return _Request(
        success=success,
        prompt_len=metrics.input_tokens,
        output_len=metrics.output_tokens if success else 0,
        ttft=chunks.ttft_s if success and chunks else 0.0,
        itl=list(chunks.itl_s) if success and chunks else [],
        latency=chunks.latency_s if success and chunks else 0.0,
        start_time=clock_origin_s + metrics.sent_s,
        queue_time=metrics.send_lag_s if math.isfinite(metrics.send_lag_s) else 0.0,
        error="" if success else (metrics.error or metrics.status),
        itl_per_token=list(metrics.itl_s),
    )


def vllm_result(result: RunResult, options: VllmResultOptions | None = None) -> dict[str, Any]:
    """The document ``vllm bench serve --save-result`` would have written for this run."""
    options = options or VllmResultOptions(label=result.shape)
    requests = [_as_vllm(m, result.clock_origin_s) for m in result.requests if not m.warmup]
    document = _setup(result, options)
    document.update(_counts(result, requests))
    document.update(_per_request(requests))
    document.update(_peaks(requests))
    if (ramp := result.config.ramp_up) is not None:
        document["rps_change_events"] = _rps_change_events(result, ramp.start_rps, ramp.end_rps)
    document.update(_percentile_figures(result, requests, options))
    # Ours, after all of vLLM's keys: every gap between tokens (n per chunk of n).
    document["splitserve_itls_per_token"] = [r.itl_per_token for r in requests]
    if not options.detailed:
        for key in DETAILED_KEYS:
            document.pop(key, None)
    return document


def _setup(result: RunResult, options: VllmResultOptions) -> dict[str, Any]:
    """``main_async``'s keys before the benchmark's own, in its order."""
    config = result.config
    backend = options.backend or BACKEND_OF_ENDPOINT.get(config.endpoint, "openai")
    model_id = options.model_id or result.model_root or result.model
    document: dict[str, Any] = {
        "date": result_date(result),
        "endpoint_type": backend,
        "backend": backend,
        "label": options.label,
        "model_id": model_id,
        "tokenizer_id": options.tokenizer_id or model_id,
        "num_prompts": options.num_prompts or config.num_requests,
        **options.metadata,
        "request_rate": config.qps if math.isfinite(config.qps) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    if (ramp := config.ramp_up) is not None:
        document["ramp_up_strategy"] = ramp.strategy
        document["ramp_up_start_rps"] = _number(ramp.start_rps)
        document["ramp_up_end_rps"] = _number(ramp.end_rps)
    return document


def _counts(result: RunResult, requests: list[_Request]) -> dict[str, Any]:
    done = [r for r in requests if r.success]
    duration = result.summary.duration_s
    per_second = 1.0 / duration if duration > 0 else 0.0
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in requests)
    goodput = _goodput(result, done)
    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(requests) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) * per_second,
        "request_goodput": None if goodput is None else goodput * per_second,
        "output_throughput": total_output * per_second,
        "total_token_throughput": (total_input + total_output) * per_second,
    }


def _goodput(result: RunResult, done: list[_Request]) -> int | None:
    """Completed requests within every SLO, judged as vLLM judges them."""
    config = result.config
    targets = {"ttft": config.slo_ttft_ms, "tpot": config.slo_tpot_ms, "e2el": config.slo_e2el_ms}
    slos = {name: ms / MS for name, ms in targets.items() if ms is not None}
    if not slos:
        return None
    good = 0
    for request in done:
        # vLLM counts a one-token answer's TPOT as 0.
        values = {"ttft": request.ttft, "tpot": _tpot(request) or 0.0, "e2el": request.latency}
        good += all(values[name] <= slo for name, slo in slos.items())
    return good


def _tpot(request: _Request) -> float | None:
    if request.output_len <= 1:
        return None
    return (request.latency - request.ttft) / (request.output_len - 1)


def _per_request(requests: list[_Request]) -> dict[str, Any]:
    return {
        "input_lens": [r.prompt_len for r in requests],
        "output_lens": [r.output_len for r in requests],
        "ttfts": [r.ttft for r in requests],
        "itls": [r.itl for r in requests],
        "latencies": [r.latency for r in requests],
        "start_times": [r.start_time for r in requests],
        "queue_times": [r.queue_time for r in requests],
        "generated_texts": ["" for _ in requests],
        "errors": [r.error for r in requests],
    }


def _peaks(requests: list[_Request]) -> dict[str, Any]:
    """vLLM's peak figures: chunks and requests in flight per whole second of the run."""
    done = [r for r in requests if r.success]
    peak_tokens, peak_concurrency = 0.0, 0
    if done:
        start = min(r.start_time for r in done)
        end = max(r.start_time + r.latency for r in done)
        seconds = int(np.ceil(end - start)) + 1
        tokens = np.zeros(seconds)
        concurrent = np.zeros(seconds)
        for request in done:
            # Each chunk's arrival: the first at TTFT, then one ITL gap after another.
            for arrival in np.cumsum([request.start_time + request.ttft, *request.itl]):
                if 0 <= (bucket := int(arrival - start)) < seconds:
                    tokens[bucket] += 1
            first = int(request.start_time - start)
            last = int(request.start_time + request.latency - start)
            concurrent[first : last + 1] += 1
        peak_tokens, peak_concurrency = float(tokens.max()), int(concurrent.max())
    return {
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
        "rtfx": 0.0,
    }


def _rps_change_events(result: RunResult, start_rps: float, end_rps: float) -> list[dict[str, Any]]:
    """Each whole rate the ramp-up reached, with the wall-clock time of the send that
    reached it (vLLM's ``rps_change_events``)."""
    ramp = result.config.ramp_up
    assert ramp is not None
    measured = [m for m in result.requests if not m.warmup]
    rates = ramp_up_rates(ramp.strategy, start_rps, end_rps, len(measured))
    last = int(start_rps)
    events = [{"rps": last, "timestamp": _iso(result.wall_origin_s)}]
    for request, rate in zip(measured, rates, strict=True):
        if int(rate) > last:
            when = _iso(result.wall_origin_s + request.scheduled_s)
            events += [{"rps": rps, "timestamp": when} for rps in range(last + 1, int(rate) + 1)]
            last = int(rate)
    return events


def _percentile_figures(
    result: RunResult, requests: list[_Request], options: VllmResultOptions
) -> dict[str, float]:
    done = [r for r in requests if r.success]
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := _tpot(r)) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    config = result.config
    # vLLM has these only where its semaphore can make a request wait.
    if config.max_concurrency is not None:
        samples["client_queue_time"] = [r.queue_time for r in done]
        if math.isfinite(config.qps):
            samples["e2el_including_client_queue"] = [r.latency + r.queue_time for r in done]
    figures: dict[str, float] = {}
    for metric in PERCENTILE_METRICS:
        if metric in options.percentile_metrics and metric in samples:
            figures.update(_figures(metric, samples[metric], options.percentiles))
    if "itl" in options.percentile_metrics:
        per_token = [gap for r in done for gap in r.itl_per_token]
        figures.update(
            _figures("itl_per_token", per_token, options.percentiles, prefix="splitserve_")
        )
    return figures


def _figures(
    name: str, seconds: Sequence[float], percentiles: Sequence[float], prefix: str = ""
) -> dict[str, float]:
    """vLLM's ``process_one_metric``: milliseconds; no sample counts as one 0."""
    values = np.asarray(seconds or [0.0], dtype=float) * MS
    figures = {
        f"{prefix}mean_{name}_ms": float(np.mean(values)),
        f"{prefix}median_{name}_ms": float(np.median(values)),
        f"{prefix}std_{name}_ms": float(np.std(values)),
    }
    for p in percentiles:
        figures[f"{prefix}p{percentile_word(p)}_{name}_ms"] = float(np.percentile(values, p))
    return figures


def percentile_word(p: float) -> str:
    """vLLM's key spelling: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


# ---- files -------------------------------------------------------------------------------


def write_vllm_result(
    result: RunResult, directory: Path, options: VllmResultOptions | None = None
) -> Path:
    """``<run id>.vllm.json`` beside the run's own records: always detailed, labelled
    with the serving shape unless ``options`` say otherwise."""
    options = options or VllmResultOptions()
    options = replace(options, detailed=True, label=options.label or result.shape)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.run_id}.vllm.json"
    path.write_text(json.dumps(vllm_result(result, options), indent=1))
    return path


def save_vllm_result(
    result: RunResult,
    options: VllmResultOptions,
    result_dir: Path | None = None,
    result_filename: str | None = None,
    append: bool = False,
) -> Path:
    """vLLM's ``--save-result`` (``--append-result``): the file and the name it chooses."""
    document = vllm_result(result, options)
    path = Path(result_filename or vllm_result_filename(result, options, document["date"]))
    if result_dir is not None:
        result_dir.mkdir(parents=True, exist_ok=True)
        path = result_dir / path
    with path.open("a+" if append else "w", encoding="utf-8") as file:
        if append and file.tell() != 0:
            file.write("\n")
        json.dump(document, file)
    return path


def vllm_result_filename(result: RunResult, options: VllmResultOptions, date: str) -> str:
    """vLLM's ``compute_result_filename`` without ``--result-filename``."""
    config = result.config
    model_id = options.model_id or result.model_root or result.model
    base_model_id = model_id.split("/")[-1]
    concurrency = (
        f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    )
    label = options.label or options.backend or BACKEND_OF_ENDPOINT[config.endpoint]
    if (ramp := config.ramp_up) is not None:
        rates = f"ramp-up-{ramp.strategy}-{_number(ramp.start_rps)}qps-{_number(ramp.end_rps)}qps"
        return f"{label}-{rates}{concurrency}-{base_model_id}-{date}.json"
    return f"{label}-{config.qps}qps{concurrency}-{base_model_id}-{date}.json"


def result_date(result: RunResult) -> str:
    """vLLM's ``date``: local ``%Y%m%d-%H%M%S`` when the run ended."""
    if math.isfinite(result.wall_origin_s):
        ended = result.wall_origin_s + result.summary.duration_s
        return datetime.datetime.fromtimestamp(ended).strftime("%Y%m%d-%H%M%S")
    try:
        return datetime.datetime.fromisoformat(result.started_at).strftime("%Y%m%d-%H%M%S")
    except ValueError:
        return result.started_at


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).isoformat()


def _number(value: float) -> int | float:
    """A rate as vLLM writes it: its ramp-up rates are integers."""
    return int(value) if float(value).is_integer() else value
