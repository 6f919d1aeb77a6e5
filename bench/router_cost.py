"""What one request costs the router's process, and where that CPU goes (benchmark, not
a test): issue 57's first measurement.

Servers, each serving the embedded model on a real vLLM engine:
  bare       vLLM's own API server (``python -m vllm.entrypoints.openai.api_server``),
             the peer: a front end doing the same work (HTTP, validation, tokenization,
             the engine client, SSE) for one engine;
  in_router  deployments/single.yaml by direct ingress, the engine's front end (vLLM's
             ``AsyncLLM``) in the router's process, as on CPUs by default;
  apart      the same with the engine in a Serve replica of its own: the router process
             then does only the router's work.
Paths: ``plain`` (a streamed completion with usage, the router's own path) and ``vllm``
(the same request with ``continuous_usage_stats``, which only vLLM's serving layer
renders, so the router hands it to vLLM's layer). Each cell runs ``--requests``
requests from ``--concurrency`` closed-loop clients (a process of its own at Ray's
worker niceness, reading raw sockets), once per ``--max-tokens`` value (ignore_eos).

The figures are the server process's CPU seconds (psutil) over the cell: per request at
the shortest length, and per relayed event from the difference between the lengths.
py-spy samples the same process meanwhile (``--nonblocking``, ``--rate`` Hz); each
sample is put in a part by its innermost frame that names one (``PARTS``), so the split
reads: parse/validate, tokenize, plan, engine client (vLLM's output processing and
detokenizer), transport (the engine link), relay/render (HTTP and SSE), metrics, Serve
(its replica wrapper), event loop, other. The shares are of the sampled Python time;
"sampled" says how much of the process's CPU that was (threads in C, Ray's core worker's,
are not sampled). ``--repeat``: rounds, each running every server once in turn; the
table gives medians over rounds.

    python bench/router_cost.py [--servers bare,in_router,apart] [--paths plain,vllm]
        [--requests 200] [--concurrency 8] [--max-tokens 1,64] [--rate 200] [--repeat 1]
        [--out results/router_cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from overhead import bare_vllm, engines_apart_url, serve_run_url
from relay_capacity import _one_stream, completion_request
from rich.console import Console
from rich.table import Table

from deployments.launcher import RAY_WORKER_NICENESS, REPO_ROOT
from engines.tiny_model import EMBEDDED_MODEL_NAME

console = Console(width=160)
PROMPT = "Summarize the following request in one sentence for an operator. " * 4
# The process whose CPU is the server's, by how its command line starts.
SERVER_PROCESS = {
    "bare": "-m vllm.entrypoints.openai.api_server",
    "in_router": "ray::ServeReplica:splitserve:Router",
    "apart": "ray::ServeReplica:splitserve:Router",
}
# (part, substrings of a py-spy frame "function (file:line)"): a sample belongs to the
# part of its innermost frame that matches one, in this order within a frame. Library
# frames that serve every part (pydantic, json) name none: a model validated in the
# request's parsing is parse/validate, one dumped in the SSE writer is relay/render.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("metrics", ("prometheus_client", "router/observation/", "ray/util/metrics")),
    ("logging", ("logging/__init__.py",)),
    (
        "tokenize",
        (
            "tokenizers",
            "tokenization_utils",
            "transformers_utils/tokenizer",
            "vllm/tokenizers",
            "apply_chat_template",
            "jinja2",
        ),
    ),
    (
        "parse/validate",
        (
            "router/http/requests.py",
            "openai/protocol.py",
            "serve/engine/protocol.py",
            "sampling_params.py",
            "fastapi/dependencies",
        ),
    ),
    (
        "plan",
        ("router/policies/", "router/dispatch.py", "router/lifecycle.py", "router/pd_flow.py"),
    ),
    ("engine client", ("vllm/v1/engine/", "vllm/v1/metrics", "detokeniz")),
    ("transport", ("engines/transport", "router/pool/", "zmq", "msgpack", "msgspec")),
    # uvicorn's write of one response chunk to the socket: a syscall per event.
    (
        "socket write",
        ("RequestResponseCycle.send (", "UVStream__try_write", "StreamWriter.write ("),
    ),
    (
        "relay/render",
        ("router/http/", "starlette", "uvicorn", "h11", "httptools", "fastapi", "vllm/entrypoints"),
    ),
    ("Serve", ("ray/serve/", "ray/_private/", "ray/_raylet", "boost::asio", "ray::")),
    # A thread's stack that ends in Thread.run is in C below it: uvloop's loop, whose
    # callbacks and polling are not Python frames.
    (
        "event loop",
        ("asyncio/", "uvloop", "selectors.py", "uv_run", "Loop__Loop__run", "task_step"),
    ),
]
# Frames of a thread that waits: py-spy reads a thread as busy from its state in /proc,
# which in this container says runnable for threads blocked in epoll or on a lock, so a
# sample whose innermost frames wait is counted idle here. The C frames are seen with
# --native (the default); Python-only stacks end at the Python frame that called them.
IDLE_FRAMES = (
    "epoll_wait", "epoll_pwait", "PyThread_acquire_lock_timed", "pthread_cond_timedwait",
    "pthread_cond_wait", "take_gil", "nanosleep", "zmq_poll", "sem_timedwait",
    "Worker.main_loop (", "Condition.wait (", "Event.wait (", "Poller.poll (",
    "_worker (concurrent/futures/thread.py", "Queue.get (queue.py",
)  # fmt: skip
IDLE_DEPTH = 4  # how many innermost frames may show the wait (libc's own are addresses)
PART_NAMES = [name for name, _ in PARTS] + ["other"]
UNATTRIBUTED = "in C under a thread"
NOT_WORK = ("idle", UNATTRIBUTED)


@dataclass(frozen=True)
class Cell:
    server: str
    path: str
    max_tokens: int
    requests: int
    concurrency: int


def request_bytes(url: str, path: str, max_tokens: int) -> tuple[str, int, bytes]:
    """Host, port and the raw HTTP request of one streamed completion on ``path``."""
    usage: dict[str, bool] = {"include_usage": True}
    if path == "vllm":
        usage["continuous_usage_stats"] = True
    fields = {
        "model": EMBEDDED_MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": usage,
    }
    return completion_request(url, fields)


async def _closed_loop(target: tuple[str, int, bytes], cell: Cell) -> dict[str, int]:
    left = cell.requests
    counts = collections.Counter[str]()

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            try:
                tokens, events = await _one_stream(*target)
                counts.update(requests=1, tokens=tokens, events=events)
            except OSError:
                counts.update(errors=1)

    await asyncio.gather(*(client() for _ in range(cell.concurrency)))
    return dict(counts)


def _client_process(target: tuple[str, int, bytes], cell: Cell) -> dict[str, int]:
    os.setpriority(os.PRIO_PROCESS, 0, RAY_WORKER_NICENESS)
    return asyncio.run(_closed_loop(target, cell))


def server_pid(server: str) -> int:
    marker = SERVER_PROCESS[server]
    found = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if marker in " ".join(p.info["cmdline"] or ())
    ]
    if len(found) != 1:
        raise RuntimeError(f"expected one {server} process ({marker!r}), found {found}")
    return found[0]


@contextlib.contextmanager
def sampled(pid: int, rate: int, folder: Path, name: str, native: bool) -> Iterator[Path]:
    """py-spy attached to ``pid`` for the block; its collapsed stacks' file."""
    out = folder / f"{name}.txt"
    command = [
        str(Path(sys.executable).parent / "py-spy"), "record", "--threads",
        "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--output", str(out),
    ]  # fmt: skip
    # Native frames need the process paused for each sample; Python frames do not.
    command.append("--native" if native else "--nonblocking")
    spy = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(RAY_WORKER_NICENESS),
    )
    time.sleep(1.0)  # attached before the load starts
    try:
        yield out
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)


@contextlib.contextmanager
def pinned_apart(pid: int) -> Iterator[None]:
    """The server process alone on one core, every other process's threads (this one's
    and so the client it starts included) on the others, until the block ends.

    Otherwise the server shares both cores with the engine and the client: py-spy counts
    a thread that waits for a core as busy (it reads the thread as runnable), and the
    split would follow the contention rather than the work."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        yield
        return
    own = {min(every)}
    _set_affinity(lambda process: own if process == pid else every - own)
    try:
        yield
    finally:
        _set_affinity(lambda process: every)


def _set_affinity(cores_of: Callable[[int], set[int]]) -> None:
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            cores = cores_of(process.pid)
            for thread in process.threads():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread.id, cores)


def part_of(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for name, markers in PARTS:
            if any(marker in frame for marker in markers):
                return name
    return "other"


def _busy_part(stack: str) -> str:
    frames = stack.split(";")
    inner = frames[-IDLE_DEPTH:]
    if any(marker in frame for frame in inner for marker in IDLE_FRAMES):
        return "idle"
    if frames[-1].startswith("Thread.run (threading.py"):
        # Below a thread's run in C with no Python frame: uvloop's loop, either polling
        # (idle) or in libuv's own work; only --native tells them apart.
        return UNATTRIBUTED
    return part_of(stack)


def split_samples(path: Path) -> dict[str, int]:
    """Samples per part from py-spy's raw output (``frame;frame;... count`` lines)."""
    parts = collections.Counter[str]()
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            parts[_busy_part(stack)] += int(count)
    return dict(parts)


def measure(
    url: str, cell: Cell, rate: int, folder: Path, pin: bool, native: bool
) -> dict[str, Any]:
    pid = server_pid(cell.server)
    process = psutil.Process(pid)
    target = request_bytes(url, cell.path, cell.max_tokens)
    name = f"{cell.server}-{cell.path}-{cell.max_tokens}"
    pinning = pinned_apart(pid) if pin else contextlib.nullcontext()
    with pinning, sampled(pid, rate, folder, name, native) as samples_path:
        before, started = process.cpu_times(), time.monotonic()
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            counts = pool.apply(_client_process, (target, cell))
        wall_s, after = time.monotonic() - started, process.cpu_times()
    cpu_s = (after.user + after.system) - (before.user + before.system)
    return {
        **asdict(cell),
        **{key: counts.get(key, 0) for key in ("requests", "tokens", "events", "errors")},
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "samples": split_samples(samples_path),
        "rate": rate,
    }


def serving(server: str) -> contextlib.AbstractContextManager[str]:
    if server == "bare":
        return bare_vllm()
    if server == "apart":
        return engines_apart_url()
    return serve_run_url()


def warm_up(url: str, path: str) -> None:
    warm = Cell("warm-up", path, 4, 8, 4)
    asyncio.run(_closed_loop(request_bytes(url, path, 4), warm))


def run_server(
    server: str, paths: list[str], lengths: list[int], args: argparse.Namespace, folder: Path
) -> list[dict[str, Any]]:
    rows = []
    with serving(server) as url:
        for path in paths:
            warm_up(url, path)
            for max_tokens in lengths:
                cell = Cell(server, path, max_tokens, args.requests, args.concurrency)
                row = measure(url, cell, args.rate, folder, not args.no_pin, args.native)
                console.print(
                    f"  {server} {path} {max_tokens} tokens: {row['requests']} requests,"
                    f" {row['errors']} errors, {row['cpu_s'] / max(row['requests'], 1) * 1e3:.2f}"
                    " ms CPU each"
                )
                rows.append(row)
    return rows


def summarize(rows: list[dict[str, Any]], lengths: list[int]) -> list[dict[str, Any]]:
    """Per (server, path): median CPU per request at the shortest length, per event from
    the lengths' difference, and the py-spy split summed over rounds."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        grouped[(row["server"], row["path"])].append(row)
    short, long = min(lengths), max(lengths)
    summary = []
    for (server, path), cells in grouped.items():
        per_request, per_event = [], []
        rounds: dict[int, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
        for cell in cells:
            rounds[cell["round"]][cell["max_tokens"]] = cell
        for by_length in rounds.values():
            s, lg = by_length.get(short), by_length.get(long)
            if s and s["requests"]:
                per_request.append(s["cpu_s"] / s["requests"])
            if s and lg and long != short and lg["requests"] and s["requests"]:
                events = lg["events"] / lg["requests"] - s["events"] / s["requests"]
                extra = lg["cpu_s"] / lg["requests"] - s["cpu_s"] / s["requests"]
                per_event.append(extra / events if events > 0 else float("nan"))
        samples = collections.Counter[str]()
        sampled_s = cpu_s = 0.0
        unattributed = 0
        for cell in cells:
            busy = {k: v for k, v in cell["samples"].items() if k not in NOT_WORK}
            unattributed += cell["samples"].get(UNATTRIBUTED, 0)
            samples.update(busy)
            sampled_s += sum(busy.values()) / cell["rate"]
            cpu_s += cell["cpu_s"]
        total = sum(samples.values()) or 1
        summary.append(
            {
                "server": server,
                "path": path,
                "cpu_ms_per_request": statistics.median(per_request) * 1e3 if per_request else None,
                "cpu_us_per_event": statistics.median(per_event) * 1e6 if per_event else None,
                "rounds": len(rounds),
                "sampled_share": sampled_s / cpu_s if cpu_s else 0.0,
                "unattributed_share": unattributed / (total + unattributed),
                "split": {name: samples.get(name, 0) / total for name in PART_NAMES},
            }
        )
    return summary


def print_table(summary: list[dict[str, Any]], args: argparse.Namespace) -> None:
    table = Table(
        title=f"Server CPU per request: {args.requests} streamed completions per cell,"
        f" {args.concurrency} in flight, max_tokens {args.max_tokens}, medians of rounds;"
        " split: share of py-spy's samples"
    )
    columns = ("server", "path", "ms/request", "µs/event", "sampled", "in C", *PART_NAMES)
    for column in columns:
        table.add_column(column, justify="right")
    for row in summary:
        per_request, per_event = row["cpu_ms_per_request"], row["cpu_us_per_event"]
        table.add_row(
            row["server"],
            row["path"],
            f"{per_request:.2f}" if per_request is not None else "-",
            f"{per_event:.0f}" if per_event is not None else "-",
            f"{row['sampled_share']:.0%}",
            f"{row['unattributed_share']:.0%}",
            *(f"{row['split'][name]:.0%}" for name in PART_NAMES),
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--servers", default="bare,in_router,apart")
    parser.add_argument("--paths", default="plain,vllm")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", default="1,64")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--native",
        action="store_true",
        help="py-spy --native: C frames too, so waits in C are told from work; it pauses"
        " the server for each sample, which here allows ~10 samples/s",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="leave the server on every core (see pinned_apart)"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "router_cost.json")
    parser.add_argument(
        "--samples",
        type=Path,
        default=REPO_ROOT / "results" / "router_cost_samples",
        help="where py-spy's collapsed stacks are kept (one file per cell and round)",
    )
    args = parser.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    unknown = set(servers) - SERVER_PROCESS.keys()
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; known: {sorted(SERVER_PROCESS)}")
    paths = [p for p in args.paths.split(",") if p]
    lengths = sorted(int(n) for n in args.max_tokens.split(","))
    rows: list[dict[str, Any]] = []
    for round_index in range(args.repeat):
        folder = args.samples / f"round-{round_index + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        for server in servers:
            console.print(f"[bold]round {round_index + 1}: {server}[/]")
            for row in run_server(server, paths, lengths, args, folder):
                rows.append({**row, "round": round_index})
    summary = summarize(rows, lengths)
    print_table(summary, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: str(value) for key, value in vars(args).items()}
    document = {"args": settings, "summary": summary, "cells": rows}
    args.out.write_text(json.dumps(document, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
