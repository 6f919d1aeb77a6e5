"""Bursts on a cold cluster and sustained overload, through both entry points (benchmark).

For each entry point (``direct``: ``python -m deployments.serve``'s direct ingress;
``proxy``: a plain ``serve run`` through Serve's proxy) it starts ``--config``
(pd.yaml by default), and as soon as ``/health`` answers 200:
  cold burst   ``--burst`` streamed completions at once (``--prompt-chars`` of text,
               ``--max-tokens`` with ignore_eos), a third each ``x-priority: high``,
               ``normal``, ``low``;
  sustained    then, after the burst drains, Poisson arrivals at ``--sustained-rate``
               req/s for ``--sustained-s`` seconds, priorities mixed the same way;
  flood        then a closed loop: ``--flood-in-flight`` clients, each sending its next
               request as soon as the last one ends, for ``--flood-s`` seconds, with
               ``--flood-chars`` of text, priorities high, normal, low, low by client
               (issue 22's flood: 72 in flight, 1,800-token prompts). A second client,
               in a process of its own, sends one low-priority request of the same size
               every ``--probe-interval-s`` meanwhile: what a new client meets at the
               flooded server, timed by a client whose event loop is not the flood's.
It prints, per phase and priority: statuses, TTFT p50/p95 of admitted requests, the
latency of refusals (503/429) p50/p95, how late the client's own event loop woke (a
probe every 10 ms: the part of those latencies that is the client's), and checks the
issue's targets: no 5xx and no connection error, high-priority TTFT p95 within
``qos.ttft_slo_s``, refusals within 100 ms (direct) and 250 ms (proxy) at p95. The
client runs at Ray's worker niceness.

    python bench/overload.py [--config pd] [--entries direct,proxy] [--burst 96]
        [--sustained-rate 6] [--sustained-s 30] [--flood-in-flight 72] [--flood-s 30]
        [--flood-chars 1800] [--probe-interval-s 0.25] [--out results/overload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import multiprocessing
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.config import load_app_config
from deployments.launcher import REPO_ROOT, config_path, niced_like_ray_workers, serve_run
from splitserve.metric_catalogue import PRIORITY_HEADER

console = Console(width=150)
PRIORITIES = ("high", "normal", "low")
FLOOD_PRIORITIES = ("high", "normal", "low", "low")
REFUSALS = (429, 503)
REFUSAL_P95_TARGET_MS = {"direct": 100.0, "proxy": 250.0}
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
]


@dataclass
class Outcome:
    priority: str
    status: int | None = None  # None: no HTTP answer (connection error)
    error: str | None = None
    sent_at: float = 0.0
    answered_s: float | None = None  # headers (a refusal's whole latency)
    ttft_s: float | None = None  # first content event
    tokens: int = 0
    stream_error: bool = False


@dataclass
class Phase:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    # How late the client's own event loop woke up: what of a latency is the client's.
    loop_lags_s: list[float] = field(default_factory=list)


LAG_PROBE_S = 0.01


async def probe_loop_lag(phase: Phase) -> None:
    """Until cancelled, how much later than asked the client's event loop wakes up."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        phase.loop_lags_s.append(time.perf_counter() - asked - LAG_PROBE_S)


@contextlib.asynccontextmanager
async def lag_probed(phase: Phase) -> AsyncIterator[None]:
    probe = asyncio.create_task(probe_loop_lag(phase))
    try:
        yield
    finally:
        probe.cancel()


@contextlib.asynccontextmanager
async def probed_session(phase: Phase) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session with no connection limit, the client's loop lag probed meanwhile."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
        lag_probed(phase),
    ):
        yield session


def prompt_text(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars]


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    priority: str,
) -> Outcome:
    outcome = Outcome(priority)
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "temperature": 0,
    }  # fmt: skip
    outcome.sent_at = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={PRIORITY_HEADER: priority}
        ) as response:
            outcome.status = response.status
            outcome.answered_s = time.perf_counter() - outcome.sent_at
            if response.status != 200:
                await response.read()
                return outcome
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if b'"error"' in line:
                    outcome.stream_error = True
                    continue
                if b'"text"' in line:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - outcome.sent_at
                    outcome.tokens += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


async def burst(url: str, model: str, args: argparse.Namespace) -> Phase:
    phase = Phase("cold burst")
    async with probed_session(phase) as session:
        requests = [
            one_request(
                session, url, model, prompt_text(args.prompt_chars, i), args.max_tokens,
                PRIORITIES[i % 3],
            )
            for i in range(args.burst)
        ]  # fmt: skip
        phase.outcomes = list(await asyncio.gather(*requests))
    return phase


async def sustained(url: str, model: str, args: argparse.Namespace) -> Phase:
    phase = Phase(f"sustained {args.sustained_rate:g} req/s")
    rng = np.random.default_rng(1)
    async with probed_session(phase) as session:
        tasks = []
        start = time.perf_counter()
        offset, index = 0.0, 0
        while offset < args.sustained_s:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            prompt = prompt_text(args.prompt_chars, 10_000 + index)
            tasks.append(
                asyncio.create_task(
                    one_request(session, url, model, prompt, args.max_tokens, PRIORITIES[index % 3])
                )
            )
            offset += rng.exponential(1.0 / args.sustained_rate)
            index += 1
        phase.outcomes = list(await asyncio.gather(*tasks))
    return phase


async def flood(url: str, model: str, args: argparse.Namespace) -> list[Phase]:
    """The flood, and the probe's requests timed in a process of their own beside it."""
    phase = Phase(f"flood {args.flood_in_flight} in flight")
    with concurrent.futures.ProcessPoolExecutor(1, multiprocessing.get_context("spawn")) as pool:
        probed = asyncio.get_running_loop().run_in_executor(
            pool, probe_process, url, model, args.flood_chars, args.max_tokens,
            args.probe_interval_s, args.flood_s,
        )  # fmt: skip
        await flooded(phase, url, model, args)
        outcomes, lags = await probed
    probe_phase = Phase("flood, probe client", [Outcome(**o) for o in outcomes], lags)
    return [phase, probe_phase]


def probe_process(
    url: str, model: str, chars: int, max_tokens: int, interval_s: float, duration_s: float
) -> tuple[list[dict[str, Any]], list[float]]:
    """In the probe's own process: its outcomes and loop lags, as plain data."""
    phase = asyncio.run(probe(url, model, chars, max_tokens, interval_s, duration_s))
    return [asdict(outcome) for outcome in phase.outcomes], phase.loop_lags_s


async def probe(
    url: str, model: str, chars: int, max_tokens: int, interval_s: float, duration_s: float
) -> Phase:
    phase = Phase("flood, probe client")
    async with probed_session(phase) as session:
        tasks = []
        start = time.perf_counter()
        for index in range(int(duration_s / interval_s)):
            await asyncio.sleep(max(0.0, start + index * interval_s - time.perf_counter()))
            prompt = prompt_text(chars, 900_000 + index)
            request = one_request(session, url, model, prompt, max_tokens, "low")
            tasks.append(asyncio.create_task(request))
        phase.outcomes = list(await asyncio.gather(*tasks))
    return phase


async def flooded(phase: Phase, url: str, model: str, args: argparse.Namespace) -> None:
    counter = iter(range(20_000, 10**9))
    end = time.perf_counter() + args.flood_s

    async def client(priority: str) -> None:
        while time.perf_counter() < end:
            prompt = prompt_text(args.flood_chars, next(counter))
            phase.outcomes.append(
                await one_request(session, url, model, prompt, args.max_tokens, priority)
            )

    async with probed_session(phase) as session:
        clients = [
            client(FLOOD_PRIORITIES[i % len(FLOOD_PRIORITIES)]) for i in range(args.flood_in_flight)
        ]
        await asyncio.gather(*clients)


def summarize(phase: Phase) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for priority in PRIORITIES:
        mine = [o for o in phase.outcomes if o.priority == priority]
        ttfts = [o.ttft_s for o in mine if o.ttft_s is not None]
        refusals = [o.answered_s for o in mine if o.status in REFUSALS and o.answered_s]
        statuses: dict[str, int] = {}
        for o in mine:
            key = str(o.status) if o.status is not None else "conn-error"
            key += "+stream-error" if o.stream_error else ""
            statuses[key] = statuses.get(key, 0) + 1
        rows[priority] = {
            "requests": len(mine),
            "statuses": statuses,
            "ttft_p50_s": pct(ttfts, 50),
            "ttft_p95_s": pct(ttfts, 95),
            "refusal_p50_ms": _ms(pct(refusals, 50)),
            "refusal_p95_ms": _ms(pct(refusals, 95)),
        }
    admitted = [o.ttft_s for o in phase.outcomes if o.ttft_s is not None]
    refused = [o.answered_s for o in phase.outcomes if o.status in REFUSALS and o.answered_s]
    rows["all"] = {
        "server_errors": sum(1 for o in phase.outcomes if o.status and o.status >= 500
                             and o.status not in REFUSALS),
        "connection_errors": sum(1 for o in phase.outcomes if o.status is None),
        "stream_errors": sum(1 for o in phase.outcomes if o.stream_error),
        "first_admitted_ttft_s": min(admitted) if admitted else None,
        "last_refusal_s": max(refused) if refused else None,
        "refusal_p95_ms": _ms(pct(refused, 95)),
        "client_loop_lag_p50_ms": _ms(pct(phase.loop_lags_s, 50)),
        "client_loop_lag_p95_ms": _ms(pct(phase.loop_lags_s, 95)),
    }  # fmt: skip
    return rows


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def verdicts(entry: str, summary: dict[str, Any], slo_s: float) -> list[str]:
    problems = []
    for phase, rows in summary.items():
        everything = rows["all"]
        if everything["server_errors"] or everything["connection_errors"]:
            problems.append(
                f"{phase}: {everything['server_errors']} 5xx,"
                f" {everything['connection_errors']} connection errors"
            )
        high = rows["high"]["ttft_p95_s"]
        if high is not None and high > slo_s:
            problems.append(f"{phase}: high-priority TTFT p95 {high:.2f} s > SLO {slo_s:g} s")
        refusal = everything["refusal_p95_ms"]
        if refusal is not None and refusal > REFUSAL_P95_TARGET_MS[entry]:
            problems.append(
                f"{phase}: refusal p95 {refusal:.0f} ms > {REFUSAL_P95_TARGET_MS[entry]:.0f} ms"
            )
    return problems


def print_entry(entry: str, summary: dict[str, Any]) -> None:
    table = Table(title=f"{entry} entry point")
    for column in (
        "phase",
        "priority",
        "statuses",
        "TTFT p50",
        "TTFT p95",
        "refusal p50",
        "refusal p95",
    ):
        table.add_column(column, justify="right")
    for phase, rows in summary.items():
        for priority in PRIORITIES:
            row = rows[priority]
            table.add_row(
                phase,
                priority,
                json.dumps(row["statuses"]),
                _s(row["ttft_p50_s"]),
                _s(row["ttft_p95_s"]),
                _msf(row["refusal_p50_ms"]),
                _msf(row["refusal_p95_ms"]),
            )
    console.print(table)
    for phase, rows in summary.items():
        everything = rows["all"]
        console.print(
            f"{phase}: the client's event loop woke late by"
            f" {_msf(everything['client_loop_lag_p50_ms'])} (p50),"
            f" {_msf(everything['client_loop_lag_p95_ms'])} (p95)"
        )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _msf(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


async def measure(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    phases = [await burst(url, model, args)] if args.burst > 0 else []
    if args.sustained_s > 0:
        phases.append(await sustained(url, model, args))
    if args.flood_s > 0:
        phases += await flood(url, model, args)
    return {phase.name: summarize(phase) for phase in phases} | {
        "_raw": {phase.name: [asdict(o) for o in phase.outcomes] for phase in phases}
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="pd")
    parser.add_argument("--entries", default="direct,proxy")
    parser.add_argument("--burst", type=int, default=96)
    parser.add_argument("--prompt-chars", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sustained-rate", type=float, default=6.0)
    parser.add_argument("--sustained-s", type=float, default=30.0)
    parser.add_argument("--flood-in-flight", type=int, default=72)
    parser.add_argument("--flood-s", type=float, default=30.0)
    parser.add_argument("--flood-chars", type=int, default=1800)
    parser.add_argument("--probe-interval-s", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "overload.json")
    args = parser.parse_args()
    path = config_path(args.config)
    config = load_app_config(path)
    slo_s = config.qos.ttft_slo_s
    results: dict[str, Any] = {"config": str(path), "args": vars(args) | {"out": str(args.out)}}
    problems: list[str] = []
    for entry in args.entries.split(","):
        console.print(f"[bold]{entry}[/]: starting {path.name}")
        with serve_run(str(path), direct_ingress=entry == "direct") as app:
            model = httpx.get(f"{app.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
            with niced_like_ray_workers():
                measured = asyncio.run(measure(app.base_url, model, args))
        raw = measured.pop("_raw")
        results[entry] = {"summary": measured, "requests": raw}
        print_entry(entry, measured)
        problems += [f"{entry}: {p}" for p in verdicts(entry, measured, slo_s)]
    results["problems"] = problems
    console.print("\n".join(problems) if problems else "[green]every target met[/]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
