"""How well does the router know what each engine has cached? (benchmark, not a test)

Two prefix signals, on the same requests (router/pool/prefix_index.py): ``kv_events`` (the
engine's own BlockStored/BlockRemoved events) and ``mirror`` (what the router sent it,
bounded by its capacity). For every request the router exports how many cached tokens
each signal expected beside the ``num_cached_tokens`` vLLM found
(``splitserve_prefix_estimate_error_tokens{signal}``, ``splitserve_prefix_cache_tokens``).

Workload: shared prefixes, as chat traffic has them. ``--systems`` long system prompts,
each followed by ``--turns`` user turns, and ``--conversations`` conversations that grow
by a turn each time, all interleaved at random, ``--concurrency`` at a time, on dp.yaml's
two engines with ``prefix_affinity``. Once with each engine's default KV cache (nothing
evicted), once with ``--small-cache-blocks`` blocks per engine, small enough that vLLM
evicts blocks all the time; and for each ``--routers`` count (2: two router replicas
over the same engines, which run apart, the client alternating between them, so each
router sends only half of what the engines hold). The client runs at Ray's worker
niceness.

    python bench/prefix_signal.py [--systems 8] [--turns 8] [--conversations 4]
        [--small-cache-blocks 48] [--routers 1,2] [--out results/prefix_signal.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import httpx
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.launcher import RAY_WORKER_NICENESS, REPO_ROOT, ROUTER_DEPLOYMENT, serve_run
from engines.tiny_model import EMBEDDED_MODEL_NAME

console = Console(width=140)
SIGNALS = ("kv_events", "mirror")
VOCAB = 256  # the embedded model's byte-level vocabulary


def workload(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Prompts as token ids: system prompt + turn, and growing conversations, shuffled
    so that a conversation's turns stay in order."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    streams: list[list[list[int]]] = []
    for _ in range(args.systems):
        system = tokens(args.system_tokens)
        streams.append([system + tokens(rng.randint(64, 256)) for _ in range(args.turns)])
    for _ in range(args.conversations):
        conversation: list[int] = tokens(args.turn_tokens)
        turns = []
        for _ in range(args.turns):
            turns.append(list(conversation))
            conversation += tokens(args.turn_tokens)
        streams.append(turns)
    order = [index for index, stream in enumerate(streams) for _ in stream]
    rng.shuffle(order)
    positions = [0] * len(streams)
    prompts = []
    for index in order:
        prompts.append(streams[index][positions[index]])
        positions[index] += 1
    return prompts


async def send_all(urls: tuple[str, ...], prompts: list[list[int]], concurrency: int) -> int:
    """Every prompt, ``concurrency`` at a time, alternating between the routers."""
    gate = asyncio.Semaphore(concurrency)
    failures = 0

    async def one(http: httpx.AsyncClient, index: int, prompt: list[int]) -> None:
        nonlocal failures
        async with gate:
            body = {"model": EMBEDDED_MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            url = f"{urls[index % len(urls)]}/v1/completions"
            response = await http.post(url, json=body)
            failures += response.status_code != 200

    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(one(http, i, prompt) for i, prompt in enumerate(prompts)))
    return failures


def signal_errors(metrics: str) -> dict[str, dict[str, float]]:
    """Per signal: requests, mean absolute error (tokens), share exactly right, and the
    cached tokens it expected against those vLLM found."""
    rows: dict[str, dict[str, float]] = {}
    for signal in SIGNALS:
        count = _sample(metrics, "splitserve_prefix_estimate_error_tokens_count", signal=signal)
        total = _sample(metrics, "splitserve_prefix_estimate_error_tokens_sum", signal=signal)
        exact = _sample(
            metrics, "splitserve_prefix_estimate_error_tokens_bucket", signal=signal, le="0.5"
        )
        rows[signal] = {
            "requests": count,
            "mean_abs_error_tokens": total / count if count else 0.0,
            "exact_share": exact / count if count else 0.0,
            "expected_tokens": _sample(
                metrics, "splitserve_prefix_cache_tokens_total", source=signal
            ),
        }
    reported = _sample(metrics, "splitserve_prefix_cache_tokens_total", source="reported")
    for row in rows.values():
        row["reported_tokens"] = reported
    return rows


def _sample(metrics: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        is_sample = line.startswith(name) and line[len(name)] in " {"
        if is_sample and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def config_with(cache_blocks: int | None, routers: int, folder: Path) -> Path:
    document = yaml.safe_load((REPO_ROOT / "deployments" / "dp.yaml").read_text())
    application = document["applications"][0]
    args = application["args"]
    args["router"]["replica_choice"] = "prefix_affinity"
    if cache_blocks is not None:
        args["pools"][0].setdefault("engine_kwargs", {})["num_gpu_blocks_override"] = cache_blocks
    if routers > 1:
        args["router"]["engine_in_router"] = False  # one set of engines for every router
        application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": routers}]
    path = folder / f"dp-prefix-{cache_blocks or 'default'}-{routers}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def measure(
    cache_blocks: int | None, routers: int, args: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    prompts = workload(args, args.seed)
    with serve_run(str(config_with(cache_blocks, routers, folder))) as app:
        urls = app.router_urls
        failures = asyncio.run(send_all(urls, prompts, args.concurrency))
        metrics = "\n".join(httpx.get(f"{url}/metrics", timeout=10).text for url in urls)
    return {
        "cache_blocks": cache_blocks or "default",
        "routers": len(urls),
        "requests": len(prompts),
        "failures": failures,
        "signals": signal_errors(metrics),
    }


def print_table(results: list[dict[str, Any]]) -> None:
    table = Table(title="prefix signal against vLLM's num_cached_tokens, per request")
    columns = ("KV cache", "routers", "signal", "requests", "mean |error|", "exact", "expected")
    for column in (*columns, "found"):
        table.add_column(column, justify="right")
    for result in results:
        for signal, row in result["signals"].items():
            table.add_row(
                f"{result['cache_blocks']} blocks",
                str(result["routers"]),
                signal,
                f"{row['requests']:.0f}",
                f"{row['mean_abs_error_tokens']:.1f} tok",
                f"{row['exact_share']:.0%}",
                f"{row['expected_tokens']:.0f}",
                f"{row['reported_tokens']:.0f}",
            )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--small-cache-blocks", type=int, default=48)
    parser.add_argument("--routers", default="1,2", help="router replica counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/prefix_signal.json"))
    args = parser.parse_args()
    os.nice(RAY_WORKER_NICENESS - os.nice(0))
    folder = Path(tempfile.mkdtemp(prefix="splitserve-prefix-"))
    results = [
        measure(blocks, int(routers), args, folder)
        for routers in args.routers.split(",")
        for blocks in (None, args.small_cache_blocks)
    ]
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
