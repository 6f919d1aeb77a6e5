"""A run in the shape ``vllm bench serve --save-result`` writes, for tools that read those.

Same key names and units as vLLM's benchmark client (vllm/benchmarks/serve.py, 0.32):
seconds in the per-request lists (``ttfts``, ``itls``, ``latencies``), milliseconds in
the ``mean_/median_/std_/pNN_<metric>_ms`` figures, ``request_rate`` "inf" when
unlimited. Only measured requests count (no warm-ups); a failed request has an empty
``itls`` list and its error text, as there. ``generated_texts`` are empty strings: the
load generator keeps token counts, not text.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.runner import RunResult
from loadgen.stats import RequestMetrics

PERCENTILES = (50, 90, 95, 99)
BACKEND_OF_ENDPOINT = {"completions": "openai", "chat": "openai-chat"}


def _figures(name: str, seconds: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds or [0.0]) * 1000
    figures = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    figures.update({f"p{p}_{name}_ms": float(np.percentile(values, p)) for p in PERCENTILES})
    return figures


def vllm_result(result: RunResult) -> dict[str, Any]:
    measured = [m for m in result.requests if not m.warmup]
    done = [m for m in measured if m.outcome == "ok"]
    summary, config = result.summary, result.config
    backend = BACKEND_OF_ENDPOINT.get(config.endpoint, "openai")
    document: dict[str, Any] = {
        "date": _date(result.started_at),
        "endpoint_type": backend,
        "backend": backend,
        "label": result.mode,
        "model_id": result.model,
        "tokenizer_id": result.model,
        "num_prompts": len(measured),
        "request_rate": config.qps if math.isfinite(config.qps) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "duration": summary.duration_s,
        "completed": len(done),
        "failed": len(measured) - len(done),
        "total_input_tokens": sum(m.input_tokens for m in done),
        "total_output_tokens": sum(m.output_tokens for m in done),
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput,
        "output_throughput": summary.output_token_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "input_lens": [m.input_tokens for m in measured],
        "output_lens": [m.output_tokens if m.outcome == "ok" else 0 for m in measured],
        "ttfts": [_or_zero(m.ttft_s) for m in measured],
        "itls": [list(m.itl_s) for m in measured],
        "latencies": [_or_zero(m.e2e_s) for m in measured],
        "start_times": [m.sent_s for m in measured],
        "generated_texts": ["" for _ in measured],
        "errors": [m.error or "" for m in measured],
    }
    document.update(_figures("ttft", [m.ttft_s for m in done if m.ttft_s is not None]))
    document.update(_figures("tpot", _tpots(done)))
    document.update(_figures("itl", [gap for m in done for gap in m.itl_s]))
    document.update(_figures("e2el", [m.e2e_s for m in done if m.e2e_s is not None]))
    return document


def write_vllm_result(result: RunResult, directory: Path) -> Path:
    """``<run id>.vllm.json`` beside the run's own records."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.run_id}.vllm.json"
    path.write_text(json.dumps(vllm_result(result), indent=1))
    return path


def _tpots(done: list[RequestMetrics]) -> list[float]:
    # vLLM counts TPOT only for requests with more than one output token.
    return [m.tpot_s for m in done if m.tpot_s is not None and m.output_tokens > 1]


def _or_zero(value: float | None) -> float:
    return 0.0 if value is None else value


def _date(started_at: str) -> str:
    """vLLM's ``%Y%m%d-%H%M%S`` from the run's ISO start time."""
    try:
        return datetime.datetime.fromisoformat(started_at).strftime("%Y%m%d-%H%M%S")
    except ValueError:
        return started_at
