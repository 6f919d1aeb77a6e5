"""How much load can our load generator produce? (benchmark, not a test)

Against loadgen's zero-latency streaming server on loopback (its own process), side by
side with vLLM's benchmark client (``vllm.benchmarks.serve``) on the same server:

  capacity  highest sustained request rate: N requests at QPS inf, at most C in flight,
            completed requests / duration, as each client reports it. Two sizes: the
            study's ``general`` (1024 -> 128 tokens) and a short one (128 -> 16), where
            per-request overhead dominates.
  send lag  actual minus scheduled send time at a constant 200 req/s (and Poisson for
            ours). vLLM's client does not record its schedule; for both clients the lag
            is also given relative to the first request (send_i - send_0 - i / rate).

Beside them, at capacity only: the same streams from a plain client on httpx and on
aiohttp (no schedule, no statistics), what writing loadgen on either would start from.

Every client run is its own process; runs alternate between the clients and repeat
``--repeats`` times, and the table shows medians (the machine may be shared).
Targets: at least twice vLLM's client's rate, p99 lag under 5 ms at 200 req/s.

    python bench/loadgen_capacity.py [--repeats 3] [--requests 3000]
        [--clients ours,vllm,httpx,aiohttp] [--out results/loadgen_capacity.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parent.parent
CONCURRENCY = 64
LAG_RATE = 200.0
LAG_REQUESTS = 2000
SIZES = {"general": (1024, 128), "short": (128, 16)}
TARGET_RATIO = 2.0
TARGET_LAG_P99_MS = 5.0
CLIENTS = ("ours", "vllm", "httpx", "aiohttp")
console = Console(width=120)


# ---- workers: one client run per process ---------------------------------------------------


def worker_ours(
    base_url: str, kind: str, size: str, requests: int, arrivals: str
) -> dict[str, Any]:
    from loadgen.config import RunConfig, WorkloadConfig
    from loadgen.scheduling.eventloop import run_event_loop
    from loadgen.scheduling.runner import execute_run

    input_len, output_len = SIZES[size]
    config = RunConfig(
        base_url=base_url,
        workload=WorkloadConfig(name="custom", input_len=input_len, output_len=output_len),
        qps=math.inf if kind == "capacity" else LAG_RATE,
        arrival_process=arrivals,
        max_concurrency=CONCURRENCY if kind == "capacity" else None,
        num_requests=requests,
        show_progress=False,
    )
    result = run_event_loop(execute_run(config, Console(quiet=True)))
    measured = [m for m in result.requests if not m.warmup]
    sent = sorted(m.sent_s for m in measured)
    return {
        "completed": result.summary.completed,
        "failed": result.summary.requests - result.summary.completed,
        "request_throughput": result.summary.request_throughput,
        "lag_ms": [m.send_lag_s * 1000 for m in measured],
        "relative_lag_ms": _relative_lag_ms(sent, LAG_RATE) if arrivals == "constant" else [],
    }


def worker_vllm(base_url: str, kind: str, size: str, requests: int) -> dict[str, Any]:
    import io
    from contextlib import redirect_stdout

    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from engines.tiny_model import embedded_model_path

    input_len, output_len = SIZES[size]
    rate = "inf" if kind == "capacity" else str(LAG_RATE)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", "fake-model", "--tokenizer", str(embedded_model_path()),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--request-rate", rate,
        "--num-prompts", str(requests), "--seed", "0", "--disable-tqdm", "--temperature", "0",
        # Without it the result drops the per-request lists (start_times, ttfts, itls).
        "--save-detailed",
    ]  # fmt: skip
    if kind == "capacity":
        argv += ["--max-concurrency", str(CONCURRENCY)]
    else:
        argv += ["--burstiness", "inf"]  # constant gaps of 1 / rate
    with redirect_stdout(io.StringIO()):
        result = main(parser.parse_args(argv))
    sent = sorted(result.get("start_times") or [])
    return {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "request_throughput": result["request_throughput"],
        "lag_ms": [],
        "relative_lag_ms": _relative_lag_ms(sent, LAG_RATE) if kind == "lag" else [],
    }


async def _plain_client_run(
    base_url: str, size: str, requests: int, stream_one: Any, session: Any
) -> dict[str, Any]:
    """``requests`` streamed completions, CONCURRENCY in flight, each read timed per chunk
    as loadgen times its reads: what a hand-written client on a library would cost."""
    input_len, output_len = SIZES[size]
    body = {
        "model": "fake-model", "prompt": [1] * input_len, "max_tokens": output_len,
        "stream": True, "ignore_eos": True,
    }  # fmt: skip
    url = f"{base_url}/v1/completions"
    remaining, failed = iter(range(requests)), 0

    async def lane() -> None:
        nonlocal failed
        for _ in remaining:
            try:
                await stream_one(session, url, body)
            except Exception:
                failed += 1

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
    duration = time.perf_counter() - started
    return {
        "completed": requests - failed,
        "failed": failed,
        "request_throughput": (requests - failed) / duration,
        "lag_ms": [],
        "relative_lag_ms": [],
    }


async def _httpx_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_raw():
            time.perf_counter()


async def _aiohttp_stream(session: Any, url: str, body: dict[str, Any]) -> None:
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for _ in response.content.iter_any():
            time.perf_counter()


def worker_httpx(base_url: str, size: str, requests: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await _plain_client_run(base_url, size, requests, _httpx_stream, client)

    return asyncio.run(run())


def worker_aiohttp(base_url: str, size: str, requests: int) -> dict[str, Any]:
    import aiohttp

    async def run() -> dict[str, Any]:
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await _plain_client_run(base_url, size, requests, _aiohttp_stream, session)

    return asyncio.run(run())


def _relative_lag_ms(sent: list[float], rate: float) -> list[float]:
    if not sent:
        return []
    return [(t - sent[0] - index / rate) * 1000 for index, t in enumerate(sent)]


# ---- the parent: server, alternation, table --------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def fake_server() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "loadgen", "fake-server", "--port", str(port)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield base_url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_worker(client: str, base_url: str, kind: str, size: str, requests: int,
               arrivals: str = "constant") -> dict[str, Any]:  # fmt: skip
    command = [
        sys.executable, __file__, "--worker", client, "--base-url", base_url, "--kind", kind,
        "--size", size, "--requests", str(requests), "--arrivals", arrivals,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{client} worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p99": math.nan}
    p50, p99 = np.percentile(values, [50, 99]).tolist()
    return {"p50": p50, "p99": p99}


def measure(base_url: str, repeats: int, requests: int, clients: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {"capacity": {}, "lag": {}}
    for size in SIZES:
        rates: dict[str, list[float]] = {client: [] for client in clients}
        for repeat in range(repeats):
            for client in clients if repeat % 2 == 0 else clients[::-1]:
                outcome = run_worker(client, base_url, "capacity", size, requests)
                if outcome["failed"]:
                    raise RuntimeError(f"{client} had {outcome['failed']} failed requests")
                rates[client].append(outcome["request_throughput"])
                console.print(
                    f"capacity {size} {client}: {outcome['request_throughput']:.0f} req/s"
                )
        results["capacity"][size] = {
            client: {"median": statistics.median(values), "runs": values}
            for client, values in rates.items()
        }
    lag_runs = {
        "ours constant": ("ours", "constant"),
        "ours poisson": ("ours", "poisson"),
        "vllm constant": ("vllm", "constant"),
    }
    for label, (client, arrivals) in lag_runs.items():
        outcome = run_worker(client, base_url, "lag", "general", LAG_REQUESTS, arrivals)
        results["lag"][label] = {
            "completed": outcome["completed"],
            "absolute_ms": _percentiles(outcome["lag_ms"]),
            "relative_to_first_ms": _percentiles(outcome["relative_lag_ms"]),
        }
        console.print(f"lag {label}: {results['lag'][label]}")
    return results


def print_tables(results: dict[str, Any]) -> None:
    table = Table(title=f"highest sustained rate: QPS inf, {CONCURRENCY} in flight (req/s, median)")
    for column in ("size", "loadgen", "vLLM client", "ratio", f"target >= {TARGET_RATIO:g}x"):
        table.add_column(column, justify="right")
    for size, by_client in results["capacity"].items():
        ours, theirs = by_client["ours"]["median"], by_client["vllm"]["median"]
        ratio = ours / theirs
        input_len, output_len = SIZES[size]
        table.add_row(
            f"{size} {input_len}->{output_len}",
            f"{ours:,.0f}",
            f"{theirs:,.0f}",
            f"{ratio:.2f}x",
            "yes" if ratio >= TARGET_RATIO else "NO",
        )
    console.print(table)
    libraries = [c for c in ("httpx", "aiohttp") if c in next(iter(results["capacity"].values()))]
    if libraries:
        plain = Table(title="the same load from a plain client on a library (req/s, median)")
        for column in ("size", "loadgen", *libraries):
            plain.add_column(column, justify="right")
        for size, by_client in results["capacity"].items():
            plain.add_row(
                size,
                *(f"{by_client[c]['median']:,.0f}" for c in ("ours", *libraries)),
            )
        console.print(plain)
    lag = Table(title=f"send lag at {LAG_RATE:g} req/s, general size (ms)")
    for column in ("client", "done", "p50", "p99", "p50 rel. first", "p99 rel. first",
                   f"p99 < {TARGET_LAG_P99_MS:g} ms"):  # fmt: skip
        lag.add_column(column, justify="right")
    for label, row in results["lag"].items():
        absolute, relative = row["absolute_ms"], row["relative_to_first_ms"]
        worst = absolute["p99"] if not math.isnan(absolute["p99"]) else relative["p99"]
        lag.add_row(
            label,
            str(row["completed"]),
            *(f"{v:.2f}" if not math.isnan(v) else "-" for v in (
                absolute["p50"], absolute["p99"], relative["p50"], relative["p99"])),
            "yes" if worst < TARGET_LAG_P99_MS else "NO",
        )  # fmt: skip
    console.print(lag)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000, help="per capacity run")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "loadgen_capacity.json")
    parser.add_argument(
        "--clients",
        default="ours,vllm,httpx,aiohttp",
        help="capacity clients; ours and vllm are required for the ratio",
    )
    parser.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=("capacity", "lag"), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=tuple(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--arrivals", default="constant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        print(
            json.dumps(
                worker_ours(args.base_url, args.kind, args.size, args.requests, args.arrivals)
            )
        )
        return
    if args.worker == "vllm":
        print(json.dumps(worker_vllm(args.base_url, args.kind, args.size, args.requests)))
        return
    if args.worker in ("httpx", "aiohttp"):
        worker = worker_httpx if args.worker == "httpx" else worker_aiohttp
        print(json.dumps(worker(args.base_url, args.size, args.requests)))
        return
    clients = args.clients.split(",")
    if not {"ours", "vllm"} <= set(clients) or not set(clients) <= set(CLIENTS):
        parser.error(f"--clients: ours and vllm, plus any of {', '.join(CLIENTS)}")
    with fake_server() as base_url:
        results = measure(base_url, args.repeats, args.requests, clients)
    print_tables(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"concurrency": CONCURRENCY, "lag_rate": LAG_RATE, **results}, indent=2)
    )
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
