"""What relaying a plain stream costs the router through its own path and through vLLM's
serving layer (benchmark, not a test): the measurement behind keeping the hand-rendered
path for plain requests (docs/DECISIONS.md).

One router in this process with synthetic engines (``step_interval_s`` 0: steps back to
back), driven over ASGI with ``--streams`` concurrent plain completions of
``--max-tokens`` tokens, ``--rounds`` times per path, the paths interleaved. The same
requests take either path: the vLLM round routes every request as if it asked for a
feature only vLLM's layer renders. The figure is the router process's CPU seconds per
relayed token (its engines are in the same process and cost the same in both rounds),
and tokens per second.

    python bench/frontend_cost.py [--streams 32] [--max-tokens 256] [--rounds 3]
        [--out results/frontend_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

import router.http.requests as requests_module
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.in_process_router import COMPLETIONS, http_client, in_process_router

PATHS = ("router", "vllm")


async def _stream(client: Any, max_tokens: int) -> int:
    body = {
        "model": EMBEDDED_MODEL_NAME,
        "prompt": [5, 6, 7],
        "max_tokens": max_tokens,
        "stream": True,
    }
    tokens = 0
    async with client.stream("POST", COMPLETIONS, content=json.dumps(body).encode()) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                tokens += 1
    return tokens


async def _round(client: Any, path: str, streams: int, max_tokens: int) -> dict[str, float]:
    original = requests_module.vllm_feature_of
    if path == "vllm":
        requests_module.vllm_feature_of = lambda request: "benchmark"
    try:
        cpu, wall = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, max_tokens) for _ in range(streams)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        requests_module.vllm_feature_of = original
    tokens = sum(counts)
    return {"tokens": tokens, "cpu_us_per_token": 1e6 * cpu / tokens, "tokens_per_s": tokens / wall}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engine = {"backend": "synthetic", "step_interval_s": 0.0}
    rounds: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
    async with in_process_router(engine=engine) as router, http_client(router) as client:
        await _round(client, "vllm", 2, 4)  # both paths warm before measuring
        await _round(client, "router", 2, 4)
        for _ in range(args.rounds):
            for path in PATHS:
                rounds[path].append(await _round(client, path, args.streams, args.max_tokens))
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "median": {
            path: {
                key: statistics.median(r[key] for r in rounds[path])
                for key in ("cpu_us_per_token", "tokens_per_s")
            }
            for path in PATHS
        },
    }


def _print(result: dict[str, Any]) -> None:
    table = Table(title="Relaying plain streams (median of interleaved rounds)")
    for column in ("path", "CPU µs / token", "tokens / s"):
        table.add_column(column, justify="right")
    for path in PATHS:
        median = result["median"][path]
        table.add_row(path, f"{median['cpu_us_per_token']:.1f}", f"{median['tokens_per_s']:.0f}")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/frontend_cost.json"))
    arguments = parser.parse_args()
    outcome = asyncio.run(main(arguments))
    _print(outcome)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(outcome, indent=2))
