"""Fair shares between API keys on a real cluster (benchmark, issue 59.4).

It serves ``--config`` (pd.yaml by default) with three API keys added (``light`` and
``flood`` of weight 1, ``heavy`` of weight 3; ``--max-prefills`` also sets
``router.max_prefills_per_engine``), finds the cluster's capacity once (the flood key
alone, a closed loop of ``--clients``), then runs ``--repeats`` interleaved rounds of:

  alone     the light key alone: Poisson arrivals at ``--light-share`` of capacity;
  shared    the same light arrivals while the flood key floods (the closed loop: its
            share is half the cluster, and it offers several times that);
  weighted  the heavy key (weight 3) and the flood key (weight 1), each a closed loop
            of ``--clients``: their starts (first tokens) in the window past
            ``--warmup-s``.

It prints, per round and as medians: the light key's TTFT p50/p95 alone and shared
(target: shared p95 within 1.5x of alone), its refusals (target 0), what the flood key
got meanwhile (requests/s, against capacity less the light key's), and the heavy/flood
ratio of starts (target 3, within 10%). Every request is streamed with ``ignore_eos``;
the client runs at Ray's worker niceness.

    python bench/fair_share.py [--config pd] [--repeats 3] [--phase-s 40] [--clients 24]
        [--prompt-chars 4000] [--max-tokens 16] [--light-share 0.2] [--max-prefills N]
        [--out results/fair_share.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from bench.overload import pct, prompt_text
from deployments.launcher import REPO_ROOT, config_path, niced_like_ray_workers, serve_run

console = Console(width=150)
KEYS = {"light": ("sk-bench-light-0123456789", 1.0), "flood": ("sk-bench-flood-0123456789", 1.0),
        "heavy": ("sk-bench-heavy-0123456789", 3.0)}  # fmt: skip
TTFT_RATIO_TARGET = 1.5
WEIGHTED_TARGET, WEIGHTED_TOLERANCE = 3.0, 0.10


@dataclass
class Sent:
    key: str
    sent_at: float
    status: int | None = None
    first_at: float | None = None  # the first content event
    error: str | None = None


class Client:
    """Streams completions for one API key, each prompt its own text."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, args: Any) -> None:
        self._session, self._url, self._model, self._args = session, url, model, args
        self._seed = iter(range(10**9))

    async def send(self, key: str) -> Sent:
        args = self._args
        body = {
            "model": self._model, "prompt": prompt_text(args.prompt_chars, next(self._seed)),
            "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
        }  # fmt: skip
        sent = Sent(key, time.perf_counter())
        headers = {"authorization": f"Bearer {KEYS[key][0]}"}
        try:
            async with self._session.post(
                f"{self._url}/v1/completions", json=body, headers=headers
            ) as response:
                sent.status = response.status
                if response.status != 200:
                    await response.read()
                    return sent
                async for line in response.content:
                    if sent.first_at is None and line.startswith(b"data: ") and b'"text"' in line:
                        sent.first_at = time.perf_counter()
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            sent.error = f"{type(error).__name__}: {error}"
        return sent

    async def closed_loop(self, key: str, clients: int, until: float) -> list[Sent]:
        done: list[Sent] = []

        async def one() -> None:
            while time.perf_counter() < until:
                sent = await self.send(key)
                done.append(sent)
                if sent.status in (429, 503):
                    await asyncio.sleep(1.0)  # Retry-After: a client that keeps to it

        await asyncio.gather(*(one() for _ in range(clients)))
        return done

    async def poisson(self, key: str, rate: float, seconds: float, seed: int) -> list[Sent]:
        rng = np.random.default_rng(seed)
        start, offset, tasks = time.perf_counter(), 0.0, []
        while offset < seconds:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(self.send(key)))
            offset += rng.exponential(1.0 / rate)
        return list(await asyncio.gather(*tasks))


def started_per_s(sent: list[Sent], since: float, until: float) -> float:
    return sum(1 for s in sent if s.first_at is not None and since <= s.first_at < until) / (
        until - since
    )


def ttfts_ms(sent: list[Sent]) -> list[float]:
    return [1000 * (s.first_at - s.sent_at) for s in sent if s.first_at is not None]


async def capacity(client: Client, args: Any) -> float:
    start = time.perf_counter()
    end = start + args.phase_s
    sent = await client.closed_loop("flood", args.clients, end)
    return started_per_s(sent, start + args.warmup_s, end)


async def round_of(client: Client, args: Any, rate: float, index: int) -> dict[str, Any]:
    alone = await client.poisson("light", rate, args.phase_s, seed=index)
    shared_start = time.perf_counter()
    shared_end = shared_start + args.phase_s
    flood_task = asyncio.create_task(client.closed_loop("flood", args.clients, shared_end))
    await asyncio.sleep(args.warmup_s)  # the flood's queue forms first
    shared = await client.poisson("light", rate, args.phase_s - args.warmup_s, seed=100 + index)
    flood = await flood_task
    start = time.perf_counter()
    end = start + args.phase_s
    heavy, flooding = await asyncio.gather(
        client.closed_loop("heavy", args.clients, end),
        client.closed_loop("flood", args.clients, end),
    )
    since = start + args.warmup_s
    return {
        "light_alone": _light(alone),
        "light_shared": _light(shared),
        "flood_per_s": started_per_s(flood, shared_start + args.warmup_s, shared_end),
        "flood_refused": sum(1 for s in flood if s.status in (429, 503)),
        "heavy_per_s": started_per_s(heavy, since, end),
        "flood_weighted_per_s": started_per_s(flooding, since, end),
        "raw": {name: [asdict(s) for s in sent] for name, sent in
                (("alone", alone), ("shared", shared), ("flood", flood), ("heavy", heavy),
                 ("flood_weighted", flooding))},
    }  # fmt: skip


def _light(sent: list[Sent]) -> dict[str, Any]:
    ttft = ttfts_ms(sent)
    return {
        "requests": len(sent),
        "refused": sum(1 for s in sent if s.status in (429, 503)),
        "failed": sum(1 for s in sent if s.error is not None or s.status not in (200, 429, 503)),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p95_ms": pct(ttft, 95),
    }


async def measure(url: str, model: str, args: Any) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = Client(session, url, model, args)
        await client.send("light")  # warm
        cap = await capacity(client, args)
        rate = args.light_share * cap
        console.print(f"capacity {cap:.2f} req/s; the light key sends {rate:.2f} req/s")
        rounds = []
        for index in range(args.repeats):
            rounds.append(await round_of(client, args, rate, index))
            console.print(f"round {index + 1} of {args.repeats} done")
    return {"capacity_per_s": cap, "light_rate_per_s": rate, "rounds": rounds}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    rounds = measured["rounds"]

    def median(get: Any) -> float | None:
        values = [v for v in (get(r) for r in rounds) if v is not None]
        return statistics.median(values) if values else None

    ratio = [r["light_shared"]["ttft_p95_ms"] / r["light_alone"]["ttft_p95_ms"] for r in rounds]
    weighted = [r["heavy_per_s"] / max(r["flood_weighted_per_s"], 1e-9) for r in rounds]
    return {
        "capacity_per_s": measured["capacity_per_s"],
        "light_rate_per_s": measured["light_rate_per_s"],
        "light_alone_p95_ms": median(lambda r: r["light_alone"]["ttft_p95_ms"]),
        "light_shared_p95_ms": median(lambda r: r["light_shared"]["ttft_p95_ms"]),
        "light_p95_ratio": statistics.median(ratio),
        "light_p95_ratios": ratio,
        "light_refused": sum(r["light_shared"]["refused"] for r in rounds),
        "flood_per_s": median(lambda r: r["flood_per_s"]),
        "heavy_to_flood": statistics.median(weighted),
        "heavy_to_flood_rounds": weighted,
    }


def print_table(measured: dict[str, Any], summary: dict[str, Any]) -> None:
    table = Table(title="fair shares between API keys (ms; req/s of first tokens)")
    for column in ("round", "light alone p50/p95", "light shared p50/p95", "p95 ratio",
                   "light refused", "flood req/s", "heavy req/s", "flood (vs heavy) req/s",
                   "heavy/flood"):  # fmt: skip
        table.add_column(column)
    for index, r in enumerate(measured["rounds"]):
        alone, shared = r["light_alone"], r["light_shared"]
        table.add_row(
            str(index + 1), f"{_f(alone['ttft_p50_ms'])}/{_f(alone['ttft_p95_ms'])}",
            f"{_f(shared['ttft_p50_ms'])}/{_f(shared['ttft_p95_ms'])}",
            f"{summary['light_p95_ratios'][index]:.2f}", str(shared["refused"]),
            f"{r['flood_per_s']:.2f}", f"{r['heavy_per_s']:.2f}",
            f"{r['flood_weighted_per_s']:.2f}", f"{summary['heavy_to_flood_rounds'][index]:.2f}",
        )  # fmt: skip
    console.print(table)
    console.print(
        f"medians: light TTFT p95 {_f(summary['light_alone_p95_ms'])} ms alone,"
        f" {_f(summary['light_shared_p95_ms'])} ms shared ({summary['light_p95_ratio']:.2f}x,"
        f" target <= {TTFT_RATIO_TARGET}); light refused {summary['light_refused']} (target 0);"
        f" flood {_f(summary['flood_per_s'], 2)} req/s of capacity"
        f" {summary['capacity_per_s']:.2f} less the light key's"
        f" {summary['light_rate_per_s']:.2f}; heavy/flood {summary['heavy_to_flood']:.2f}"
        f" (target {WEIGHTED_TARGET:g} within {WEIGHTED_TOLERANCE:.0%})"
    )


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def config_with_keys(path: Path, max_prefills: int | None) -> Path:
    """``path`` with the bench's API keys (and the prefill gate) added, as a temp file."""
    config = yaml.safe_load(path.read_text())
    (app,) = config["applications"]
    keys = [{"name": name, "key": key, "weight": weight} for name, (key, weight) in KEYS.items()]
    app["args"]["auth"] = {"keys": keys}
    if max_prefills is not None:
        app["args"].setdefault("router", {})["max_prefills_per_engine"] = max_prefills
    out = Path(tempfile.mkdtemp(prefix="fair-share-")) / path.name
    out.write_text(yaml.safe_dump(config))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="pd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=40.0)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--prompt-chars", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--light-share", type=float, default=0.2)
    parser.add_argument("--max-prefills", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "fair_share.json")
    args = parser.parse_args()
    path = config_with_keys(config_path(args.config), args.max_prefills)
    console.print(f"starting {args.config} with the bench's keys ({path})")
    with serve_run(str(path)) as app:
        headers = {"authorization": f"Bearer {KEYS['light'][0]}"}
        models = httpx.get(f"{app.base_url}/v1/models", headers=headers, timeout=10).json()
        with niced_like_ray_workers():
            measured = asyncio.run(measure(app.base_url, models["data"][0]["id"], args))
    summary = summarize(measured)
    print_table(measured, summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args) | {"out": str(args.out)}, "summary": summary, **measured}
    args.out.write_text(json.dumps(result, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
