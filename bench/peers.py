"""Our shapes beside plain peers, on the same cores, under one client (benchmark, not a test).

Servers, one at a time, each driven by vLLM's own benchmark client (random prompts,
ignore_eos, Poisson arrivals, everything at Ray's worker niceness 15):
  bare        one bare vLLM OpenAI server (the peer of single)
  vllm-router two bare vLLM servers, one core each, behind `vllm-router --policy
              round_robin` from PyPI, in a virtualenv of its own (the peer of dp)
  single, dp, pd_always, pd   our YAMLs as `python -m deployments.serve NAME` serves them
  dp_apart, pd_apart  dp.yaml and pd.yaml with router.engine_in_router: false (each
              engine a Serve replica of its own, reached over the engine transport's TCP
              connection)
  vllm-router_beside_ray  the peer again, with dp.yaml's Ray cluster idle beside it
  bare_beside_ray         bare vLLM again, with single.yaml's Ray cluster idle beside it
  dp_one_node, dp_two_nodes, pd_always_one_node, pd_always_two_nodes
              the YAML with each engine placed on a slot of its pool's role and the
              router on the head node, served by a `ray start` cluster of one node (every
              slot) or two nodes on this box (one engine each; deployments.local_nodes):
              the same engine path within a node and across nodes
Cells: 512->64 at 4 req/s (the issue's), decode-heavy 128->512, prefill-heavy 2048->32.
Prints TTFT p50/p99, ITL p50/p90/mean/p99 and req/s per server and cell (medians over
``--repeat`` rounds; each round starts every server in turn, so ours and the peers
interleave and share the box's drift), with each row's ratio to its peer (single: bare;
dp: vllm-router; pd_always and pd: dp; pd_apart: pd; X_two_nodes: X_one_node), checks
the targets of docs/DECISIONS.md and saves JSON with every run.

    python bench/peers.py [--servers bare,vllm-router,single,dp,pd_always,pd]
        [--cells general,decode,prefill] [--num-prompts 100] [--repeat 1]
        [--out results/peers.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from overhead import (
    bare_vllm,
    engines_apart_url,
    peer_tool,
    run_client,
    serve_run_url,
    served,
)
from rich.console import Console
from rich.table import Table

from deployments.launcher import (
    RAY_WORKER_NICENESS,
    REPO_ROOT,
    niced_like_ray_workers,
    serve_run,
)
from deployments.local_nodes import LABEL, NodeSpec, local_nodes

console = Console(width=160)  # the table stays readable in a log file
VLLM_ROUTER_VERSION = "0.1.17"
VLLM_ROUTER_PORT = 8100
BARE_WORKER_PORTS = (8101, 8102)


@dataclass(frozen=True)
class Cell:
    name: str
    input_len: int
    output_len: int
    request_rate: float


CELLS = {
    "general": Cell("512->64", 512, 64, 4.0),
    "decode": Cell("decode-heavy 128->512", 128, 512, 1.0),
    "prefill": Cell("prefill-heavy 2048->32", 2048, 32, 2.0),
}
# Which row each row is measured against, and the targets (ratio ceilings) it must meet.
PEER_OF = {
    "single": "bare",
    "dp": "vllm-router",
    "dp_apart": "vllm-router",
    "vllm-router_beside_ray": "vllm-router",
    "bare_beside_ray": "bare",
    "pd_always": "dp",
    "pd": "dp",
    "pd_apart": "pd",
    "dp_two_nodes": "dp_one_node",
    "pd_always_two_nodes": "pd_always_one_node",
}
TWO_NODES_TTFT_CEILING = 1.25
TARGETS: dict[tuple[str, str], dict[str, float]] = {
    ("dp", "general"): {
        "ttft_p50_ms": 1.10,
        "itl_mean_ms": 1.10,
        "itl_p99_ms": 1.5,
        "itl_p50_ms": 1.15,
        "itl_p90_ms": 1.15,
    },
    ("dp_apart", "general"): {
        "ttft_p50_ms": 1.10,
        "itl_mean_ms": 1.10,
        "itl_p99_ms": 1.5,
        "itl_p50_ms": 1.15,
        "itl_p90_ms": 1.15,
    },
    ("pd_always", "prefill"): {"ttft_p50_ms": 1.5},
    ("pd_always", "decode"): {"itl_mean_ms": 1.10},
    ("single", "general"): {"ttft_p50_ms": 1.25, "itl_mean_ms": 1.10},
    ("dp_two_nodes", "general"): {"ttft_p50_ms": TWO_NODES_TTFT_CEILING},
    ("pd_always_two_nodes", "general"): {"ttft_p50_ms": TWO_NODES_TTFT_CEILING},
}
HEAD_NODE = "head"


def vllm_router_binary() -> Path:
    return peer_tool("vllm-router", VLLM_ROUTER_VERSION, "vllm-router")


@contextlib.contextmanager
def vllm_router_over_bare_servers() -> Iterator[str]:
    """Two bare vLLM servers bound one core each, vllm-router round-robin in front."""
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(
                bare_vllm(port, {"VLLM_CPU_OMP_THREADS_BIND": str(core)}, f"bare-vllm-{core}")
            )
            for core, port in enumerate(BARE_WORKER_PORTS)
        ]
        command = [
            str(vllm_router_binary()), "--host", "127.0.0.1", "--port", str(VLLM_ROUTER_PORT),
            "--policy", "round_robin", "--worker-urls", *urls,
        ]  # fmt: skip
        base_url = f"http://127.0.0.1:{VLLM_ROUTER_PORT}"
        ready_url = f"{base_url}/v1/models"
        stack.enter_context(served(command, "vllm-router", ready_url, RAY_WORKER_NICENESS))
        yield base_url


@contextlib.contextmanager
def beside_idle_ray(
    shape: str, peer: Callable[[], contextlib.AbstractContextManager[str]]
) -> Iterator[str]:
    """The peer while our ``shape``'s Ray cluster idles beside it: what Ray's own
    processes (GCS, raylet, dashboard, Serve's controller and proxy, idle engines) take
    from two cores, charged to the peer instead of to us."""
    with serve_run_url(REPO_ROOT / "deployments" / f"{shape}.yaml"), peer() as url:
        yield url


def _engine_slot(role: str) -> str:
    return f"splitserve_{role}_slot"


@contextlib.contextmanager
def on_local_nodes(shape: str, node_count: int) -> Iterator[str]:
    """``shape``'s YAML with each engine asking for one slot of its pool's role and the
    router pinned to the head, on ``node_count`` `ray start` nodes of this box that deal
    the engines' slots out in turn: one node holds them all; two hold one engine each."""
    document = yaml.safe_load((REPO_ROOT / "deployments" / f"{shape}.yaml").read_text())
    args = document["applications"][0]["args"]
    engine_roles = []
    for pool in args["pools"]:
        pool["placement"] = {"resources": {_engine_slot(pool["role"]): 1}}
        engine_roles += [pool["role"]] * pool.get("replicas", 1)
    args.setdefault("router", {})["placement"] = {"node_labels": {LABEL: HEAD_NODE}}
    slots: list[dict[str, float]] = [{} for _ in range(node_count)]
    for index, role in enumerate(engine_roles):
        node_slots = slots[index % node_count]
        node_slots[_engine_slot(role)] = node_slots.get(_engine_slot(role), 0) + 1
    roles = [HEAD_NODE, *(f"worker-{index}" for index in range(1, node_count))]
    nodes = [NodeSpec(role, resources=slot) for role, slot in zip(roles, slots, strict=True)]
    with tempfile.TemporaryDirectory() as folder, local_nodes(nodes) as cluster:
        path = Path(folder) / f"{shape}-{node_count}-nodes.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        with serve_run(str(path), ray_address=cluster.address) as app:
            yield app.base_url


def ours(name: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
    return lambda: serve_run_url(REPO_ROOT / "deployments" / f"{name}.yaml")


SERVERS: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
    "bare": bare_vllm,
    "vllm-router": vllm_router_over_bare_servers,
    "vllm-router_beside_ray": lambda: beside_idle_ray("dp", vllm_router_over_bare_servers),
    "bare_beside_ray": lambda: beside_idle_ray("single", bare_vllm),
    "single": ours("single"),
    "dp": ours("dp"),
    "pd_always": ours("pd_always"),
    "pd": ours("pd"),
    # Each engine a Serve replica of its own, behind the engine transport.
    "dp_apart": lambda: engines_apart_url(REPO_ROOT / "deployments" / "dp.yaml"),
    "pd_apart": lambda: engines_apart_url(REPO_ROOT / "deployments" / "pd.yaml"),
    "dp_one_node": lambda: on_local_nodes("dp", 1),
    "dp_two_nodes": lambda: on_local_nodes("dp", 2),
    "pd_always_one_node": lambda: on_local_nodes("pd_always", 1),
    "pd_always_two_nodes": lambda: on_local_nodes("pd_always", 2),
}


def _warm_up(base_url: str) -> None:
    """A few requests first: the first one through a fresh server pays its set-up."""
    body = {"model": "splitserve-tiny-llama", "prompt": [1, 2, 3], "max_tokens": 4}
    for _ in range(4):
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


FIGURES = (
    "request_throughput", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms",
    "itl_mean_ms", "itl_p99_ms", "tokens_per_event",
)  # fmt: skip
# Issue 57: a stream that arrives in clumps shows as an ITL p50 near zero in some run.
# No run of ours may read below this share of its peer's ITL p50 in the same round.
CLUMPED_ITL_SHARE = 0.5


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over repeated runs of one cell, with the runs kept beside."""
    row = {key: float(np.median([run[key] for run in runs])) for key in FIGURES}
    return {**row, "runs": runs}


def measure(
    servers: list[str], cells: list[str], num_prompts: int, repeat: int = 1
) -> dict[str, Any]:
    """``repeat`` rounds, each starting every server in turn and running every cell:
    ours and the peers interleave, so the box's drift between runs reaches them all."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_index in range(repeat):
        for server in servers:
            console.print(f"[bold]{server}[/]: starting (round {round_index + 1}/{repeat})")
            with SERVERS[server]() as base_url, niced_like_ray_workers():
                _warm_up(base_url)
                for cell_key in cells:
                    cell = CELLS[cell_key]
                    started = time.monotonic()
                    run = run_client(
                        base_url, cell.request_rate, num_prompts, cell.input_len,
                        cell.output_len,
                    )  # fmt: skip
                    runs.setdefault(server, {}).setdefault(cell_key, []).append(run)
                    console.print(
                        f"  {cell.name}: TTFT p50 {run['ttft_p50_ms']:.1f} ms, ITL p50"
                        f" {run['itl_p50_ms']:.2f} ms, mean {run['itl_mean_ms']:.2f} ms"
                        f" ({time.monotonic() - started:.0f} s)"
                    )
    return {
        server: {cell: median_run(cell_runs) for cell, cell_runs in by_cell.items()}
        for server, by_cell in runs.items()
    }


def ratios(results: dict[str, Any], server: str, cell: str) -> dict[str, float] | None:
    peer = PEER_OF.get(server)
    if peer is None or cell not in results.get(peer, {}):
        return None
    row, base = results[server][cell], results[peer][cell]
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_mean_ms", "itl_p99_ms")
    return {key: row[key] / base[key] for key in keys if base.get(key)}


def smoothness(results: dict[str, Any], server: str, cell: str) -> dict[str, Any] | None:
    """The lowest ratio of a run's ITL p50 to its peer's in the same round."""
    peer = PEER_OF.get(server)
    if peer is None or cell not in results.get(peer, {}):
        return None
    ours, theirs = results[server][cell]["runs"], results[peer][cell]["runs"]
    lowest = min(a["itl_p50_ms"] / b["itl_p50_ms"] for a, b in zip(ours, theirs, strict=False))
    return {
        "server": server, "cell": cell, "figure": "lowest run itl_p50_ms", "ratio": lowest,
        "limit": CLUMPED_ITL_SHARE, "met": lowest >= CLUMPED_ITL_SHARE,
    }  # fmt: skip


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for server, cells in results.items():
        for cell in cells:
            smooth = smoothness(results, server, cell)
            if smooth is not None:
                found.append(smooth)
    for (server, cell), limits in TARGETS.items():
        measured = ratios(results, server, cell) if server in results else None
        if measured is None:
            continue
        for key, limit in limits.items():
            found.append(
                {"server": server, "cell": cell, "figure": key, "ratio": measured[key],
                 "limit": limit, "met": measured[key] <= limit}
            )  # fmt: skip
    return found


def print_table(results: dict[str, Any]) -> None:
    table = Table(title="Peers and our shapes (vLLM's benchmark client, niceness 15)")
    columns = ("server", "cell", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p90")
    for column in (*columns, "ITL mean", "ITL p99", "tok/event"):
        table.add_column(column, justify="left" if column in ("server", "cell") else "right")
    table.add_column("vs peer (TTFT p50 / ITL p50 / p90 / mean / p99)")
    keys = ("ttft_p50_ms", "itl_p50_ms", "itl_p90_ms", "itl_mean_ms", "itl_p99_ms")
    for server, cells in results.items():
        for cell, row in cells.items():
            measured = ratios(results, server, cell)
            versus = (
                f"{PEER_OF[server]}: "
                + " / ".join(f"{measured[key]:.2f}x" if key in measured else "-" for key in keys)
                if measured
                else ""
            )
            table.add_row(
                server,
                CELLS[cell].name,
                f"{row['request_throughput']:.2f}",
                *(f"{row[key]:.1f} ms" for key in ("ttft_p50_ms", "ttft_p99_ms")),
                *(f"{row[key]:.2f} ms" for key in ("itl_p50_ms", "itl_p90_ms", "itl_mean_ms")),
                f"{row['itl_p99_ms']:.2f} ms",
                f"{row['tokens_per_event']:.2f}",
                versus,
            )
    console.print(table)
    for verdict in verdicts(results):
        mark = "met" if verdict["met"] else "[red]missed[/]"
        bound = "at least" if verdict["figure"].startswith("lowest") else "limit"
        console.print(
            f"target {verdict['server']} {verdict['cell']} {verdict['figure']}:"
            f" {verdict['ratio']:.2f}x ({bound} {verdict['limit']}x) {mark}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over every server, interleaved; figures are medians",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "peers.json")
    args = parser.parse_args()
    servers, cells = args.servers.split(","), args.cells.split(",")
    for name in servers:
        if name not in SERVERS:
            parser.error(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")
    for name in cells:
        if name not in CELLS:
            parser.error(f"unknown cell {name!r}; choose from {', '.join(CELLS)}")
    results = measure(servers, cells, args.num_prompts, args.repeat)
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "cells": {key: asdict(CELLS[key]) for key in cells},
        "num_prompts": args.num_prompts,
        "repeat": args.repeat,
        "results": results,
        "targets": verdicts(results),
    }
    args.out.write_text(json.dumps(document, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
