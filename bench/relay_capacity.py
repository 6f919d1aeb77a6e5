"""How many streamed tokens per second our router relays to clients (benchmark, not a test).

The engines are ``engine.backend: synthetic``: no model, every running request gets a
token per step, steps back to back, so the router (request parsing, the engine link,
the delta demultiplexer, the SSE writer, its metrics) is what limits. For each count of
router replicas R (a Serve ``num_replicas`` override of the Router deployment; each
replica hosts its own engines and serves a port of its own by direct ingress), the
client keeps ``--streams`` completions of ``--max-tokens`` tokens open, spread over the
routers' ports as a load balancer would, for ``--duration-s`` seconds, from
``--client-processes`` processes at Ray's worker niceness. On a two-core box the client
shares the cores with the routers: the figure is a floor, and the client's own share is
printed beside it. ``--layouts``: ``in_router`` (each router hosts engines of its own)
and ``apart`` (engines in Serve replicas of their own, shared by every router over the
engine transport). ``--peer vllm-router``: the same client against vllm-router
(Rust, round robin) over ``--engines`` of the load generator's fake servers, which
stream tokens back to back as the synthetic engines do; its row is the bar for a relay
that only forwards bytes. ``--repeat``: rounds, each running every row once in turn
(this box drifts between runs: compare rows within a round, and medians).

Both engines here are faster than any relay. Apart (and behind vllm-router) the relay
is then behind its engines: ours sends what waits for a request as one event of several
tokens (as vLLM's server does; router/pool/mailbox.py); the fake servers send a token
an event, which vllm-router forwards as it reads them. In the router, the synthetic
engine steps in the relays' own event loop, between their turns, so it is never ahead
of them: that row writes a token an event and measures the per-token path alone. (A
vLLM engine in the router is not like it: its engine core steps in a process of its
own, and a relay that falls behind reads joined chunks, as apart.) So read tokens/s per
router core (what the issue's target is) beside events/s per router core (the cost of
one write's framing).

    python bench/relay_capacity.py [--layouts in_router,apart] [--router-replicas 1,2]
        [--peer vllm-router] [--engines 2] [--streams 64] [--max-tokens 512]
        [--duration-s 20] [--client-processes 1] [--repeat 1]
        [--out results/relay_capacity.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from overhead import cpu_seconds_by_role, peer_tool, served
from rich.console import Console
from rich.table import Table

from deployments.launcher import (
    RAY_WORKER_NICENESS,
    REPO_ROOT,
    ROUTER_DEPLOYMENT,
    serve_run,
)
from engines.tiny_model import EMBEDDED_MODEL_NAME
from loadgen.client.fake_server import FAKE_MODEL_NAME

console = Console(width=140)
DP_YAML = REPO_ROOT / "deployments" / "dp.yaml"
SSE_EVENT = b"data: "
SSE_DONE = b"data: [DONE]"
USAGE_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
READ_BLOCK = 1 << 16
VLLM_ROUTER_VERSION = "0.1.17"  # as bench/peers.py
PEER_PORT = 8200  # vllm-router; its fake servers on the ports after it
# The process whose CPU is "the router's" in each row.
ROUTER_ROLE = {"vllm-router": "vllm-router"}


@dataclass(frozen=True)
class Load:
    streams: int
    max_tokens: int
    duration_s: float


def synthetic_app(router_replicas: int, engines: int, layout: str) -> dict[str, Any]:
    """dp.yaml with synthetic engines and ``router_replicas`` routers."""
    document = yaml.safe_load(DP_YAML.read_text())
    application = document["applications"][0]
    args = application["args"]
    args["engine"] = {"backend": "synthetic"}
    args["pools"] = [{"role": "mixed", "replicas": engines}]
    args["router"]["engine_in_router"] = layout == "in_router"
    application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": router_replicas}]
    return document


@contextlib.contextmanager
def serving(router_replicas: int, engines: int, layout: str) -> Iterator[tuple[str, ...]]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"relay-{layout}-{router_replicas}.yaml"
        document = synthetic_app(router_replicas, engines, layout)
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        with serve_run(str(path)) as app:
            yield app.router_urls


@contextlib.contextmanager
def vllm_router(engines: int) -> Iterator[tuple[str, ...]]:
    """vllm-router, round robin, over ``engines`` fake servers, all at Ray's worker
    niceness as our routers and engines run."""
    binary = peer_tool("vllm-router", VLLM_ROUTER_VERSION, "vllm-router")
    with contextlib.ExitStack() as stack:
        urls = []
        for index in range(engines):
            port = PEER_PORT + 1 + index
            url = f"http://127.0.0.1:{port}"
            fake = [sys.executable, "-m", "loadgen", "fake-server", "--port", str(port)]
            stack.enter_context(
                served(fake, f"relay-fake-{index}", f"{url}/v1/models", RAY_WORKER_NICENESS)
            )
            urls.append(url)
        command = [
            str(binary), "--host", "127.0.0.1", "--port", str(PEER_PORT),
            "--policy", "round_robin", "--worker-urls", *urls,
        ]  # fmt: skip
        base_url = f"http://127.0.0.1:{PEER_PORT}"
        stack.enter_context(
            served(command, "relay-vllm-router", f"{base_url}/v1/models", RAY_WORKER_NICENESS)
        )
        yield (base_url,)


def completion_request(url: str, fields: dict[str, Any]) -> tuple[str, int, bytes]:
    """Host, port and the raw HTTP request of one completion of ``fields`` (a request a
    connection, as _one_stream reads it)."""
    address = urlsplit(url)
    body = json.dumps(fields).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    return address.hostname or "127.0.0.1", address.port or 80, head + body


def _request_bytes(url: str, max_tokens: int, model: str) -> tuple[str, int, bytes]:
    """One streamed completion with its usage."""
    fields = {
        "model": model,
        "prompt": "relay",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return completion_request(url, fields)


async def _one_stream(host: str, port: int, request: bytes) -> tuple[int, int]:
    """Tokens (from the usage event) and SSE events of one streamed completion.

    A plain socket read in large blocks, not an HTTP client: on two cores the client
    shares the routers' cores, and httpx parsing every chunk took 0.7-0.9 of one, so
    the figure measured the client. Events are counted across block boundaries by
    keeping the last bytes of each block. A router that falls behind an engine
    sends several tokens in one event, as vLLM's server does, so events undercount
    tokens.
    """
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        first = await reader.read(READ_BLOCK)
        if not first.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(first.split(b"\r\n", 1)[0].decode(errors="replace"))
        events, event_carry, done_carry, tail = 0, b"", b"", b""
        chunk = first
        while chunk:
            # Each pattern keeps one byte less than itself, so no match is counted twice.
            event_scan, done_scan = event_carry + chunk, done_carry + chunk
            events += event_scan.count(SSE_EVENT) - done_scan.count(SSE_DONE)
            event_carry = event_scan[-(len(SSE_EVENT) - 1) :]
            done_carry = done_scan[-(len(SSE_DONE) - 1) :]
            tail = (tail + chunk)[-512:]
            chunk = await reader.read(READ_BLOCK)
    finally:
        writer.close()
    found = USAGE_TOKENS.search(tail)
    return (int(found.group(1)) if found else 0), events


async def _client(urls: list[str], load: Load, first_stream: int, model: str) -> dict[str, int]:
    tokens = events = requests = errors = 0
    deadline = time.monotonic() + load.duration_s
    targets = [_request_bytes(url, load.max_tokens, model) for url in urls]

    async def keep_streaming(index: int) -> None:
        nonlocal tokens, events, requests, errors
        target = targets[index % len(targets)]
        while time.monotonic() < deadline:
            try:
                got, sent = await _one_stream(*target)
                tokens, events, requests = tokens + got, events + sent, requests + 1
            except OSError:  # refused, reset, or a status other than 200
                errors += 1

    await asyncio.gather(*(keep_streaming(first_stream + i) for i in range(load.streams)))
    return {"tokens": tokens, "events": events, "requests": requests, "errors": errors}


def _client_process(urls: list[str], load: Load, first_stream: int, model: str) -> dict[str, int]:
    os.setpriority(os.PRIO_PROCESS, 0, RAY_WORKER_NICENESS)
    return asyncio.run(_client(urls, load, first_stream, model))


def measure(
    urls: tuple[str, ...], load: Load, client_processes: int, model: str = EMBEDDED_MODEL_NAME
) -> dict[str, Any]:
    per_process = Load(load.streams // client_processes, load.max_tokens, load.duration_s)
    before, started = cpu_seconds_by_role(), time.monotonic()
    with multiprocessing.get_context("spawn").Pool(client_processes) as pool:
        parts = pool.starmap(
            _client_process,
            [
                (list(urls), per_process, i * per_process.streams, model)
                for i in range(client_processes)
            ],
        )
    wall_s, after = time.monotonic() - started, cpu_seconds_by_role()
    counted = ("tokens", "events", "requests", "errors")
    totals = {key: sum(part[key] for part in parts) for key in counted}
    return {
        **totals,
        "wall_s": wall_s,
        "tokens_per_s": totals["tokens"] / wall_s,
        "requests_per_s": totals["requests"] / wall_s,
        "cpu_share": {
            role: round((seconds - before.get(role, 0.0)) / wall_s, 3)
            for role, seconds in sorted(after.items())
        },
    }


def print_table(rows: dict[str, dict[str, Any]], load: Load) -> None:
    table = Table(
        title=f"Router relay capacity: synthetic engines, {load.streams} streams of"
        f" {load.max_tokens} tokens, {load.duration_s:.0f} s, client at niceness 15"
    )
    columns = ("layout, routers", "tokens/s", "tokens/event", "requests/s", "errors")
    per_core = ("tokens/s per router core", "events/s per router core")
    for column in (*columns, "router CPU", "engine replicas' CPU", *per_core):
        table.add_column(column, justify="right")
    table.add_column("client CPU", justify="right")
    for key, row in rows.items():
        share = row["cpu_share"]
        router_cores = share.get(ROUTER_ROLE.get(row["layout"], "router"), 0.0)
        engine_cores = share.get("engine replica", 0.0) + share.get("fake server", 0.0)
        table.add_row(
            key,
            f"{row['tokens_per_s']:,.0f}",
            f"{row['tokens'] / max(row['events'], 1):.1f}",
            f"{row['requests_per_s']:.1f}",
            str(row["errors"]),
            f"{router_cores:.2f} cores",
            f"{engine_cores:.2f} cores",
            f"{row['tokens_per_s'] / router_cores:,.0f}" if router_cores else "-",
            f"{row['events'] / row['wall_s'] / router_cores:,.0f}" if router_cores else "-",
            f"{row['client_cpu_share']:.2f} cores",
        )
    console.print(table)


def run_cell(
    layout: str, replicas: int, engines: int, load: Load, client_processes: int
) -> dict[str, Any]:
    """One row: start what serves it, measure, stop."""
    peer = layout in ROUTER_ROLE
    server = vllm_router(engines) if peer else serving(replicas, engines, layout)
    with server as urls:
        client_before = _own_cpu_seconds()
        model = FAKE_MODEL_NAME if peer else EMBEDDED_MODEL_NAME
        row = measure(urls, load, client_processes, model)
        row["client_cpu_share"] = (_own_cpu_seconds() - client_before) / row["wall_s"]
    row["layout"] = layout
    return row


def _own_cpu_seconds() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layouts", default="in_router,apart")
    parser.add_argument("--router-replicas", default="1,2")
    parser.add_argument(
        "--engines", type=int, default=2, help="synthetic engines (in_router: per router)"
    )
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--peer", default="", help="vllm-router: add its row (empty: none)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "relay_capacity.json")
    args = parser.parse_args()
    load = Load(args.streams, args.max_tokens, args.duration_s)
    cells = [
        (layout, int(replicas))
        for layout in args.layouts.split(",")
        if layout
        for replicas in args.router_replicas.split(",")
    ]
    if args.peer:
        cells.append((args.peer, 1))
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_index in range(args.repeat):
        rows: dict[str, dict[str, Any]] = {}
        for layout, replicas in cells:
            key = f"{layout}, {replicas}"
            console.print(f"[bold]round {round_index + 1}: {key} router(s)[/]: starting")
            rows[key] = run_cell(layout, replicas, args.engines, load, args.client_processes)
            row = rows[key]
            console.print(f"  {row['tokens_per_s']:,.0f} tokens/s, {row['errors']} errors")
        print_table(rows, load)
        rounds.append(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {"load": asdict(load), "engines": args.engines, "rounds": rounds}
    args.out.write_text(json.dumps(document, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
