"""What the router's decisions cost a request, by fleet size (benchmark, not a test).

One request's decisions, as the router makes them before any engine is asked: QoS's
early check (the queue, the soonest first token any engine could give), the
dispatcher's plan (engine choice, the prefill policy's inputs for PD and auto, the
prompt's prefix hits), QoS's check of the plan's TTFT estimate, and the plan's start
bookkeeping (the prompt recorded, the prefill queued and let in, then finished), over
N engines whose loads are spread the way a busy fleet's are. No HTTP, no engine, no
event loop: the decision objects alone, so that the figure is what fleet size adds.

    python bench/decision_cost.py [--engines 2,64,512] [--requests 20000]
        [--shapes dp,pd,auto] [--choice least_loaded] [--repeats 3]
        [--out results/decision_cost]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.config import parse_app_config
from engines.protocol import CacheUpdate, EngineRole, EngineStats, GenerateRequest
from kv_transfer.builtin_backends import PlainRouterSide
from router.dispatch import Dispatcher
from router.policies.qos import AdmissionControl
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineState
from router.pool.pooled_engine import PooledEngine
from router.pool.prefix_index import PromptBlocks
from router.settings import Priority

console = Console()
PROMPT_TOKENS = 1024
BLOCK_SIZE = 16
# How a busy fleet's engines differ: requests each runs, and its KV cache's use.
RUNNING = range(0, 48)


class _Link:
    """Nothing reaches an engine here: the decisions are timed, not the engines."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the decision bench calls no engine ({name})")


def pools_for(shape: str, engines: int) -> list[dict[str, Any]]:
    if shape == "pd":
        return [
            {"role": "prefill", "replicas": engines // 2},
            {"role": "decode", "replicas": engines - engines // 2},
        ]
    return [{"role": "mixed", "replicas": engines}]


def fleet(
    shape: str, engines: int, choice: str, rng: random.Random
) -> tuple[Dispatcher, AdmissionControl, EnginePool]:
    args: dict[str, Any] = {
        "shape": shape,
        "pools": pools_for(shape, engines),
        "router": {"replica_choice": choice},
        "qos": {"enabled": True, "ttft_slo_s": 60.0, "early_rejection_s": {"low": 60.0}},
    }
    if shape == "pd":
        args["prefill_policy"] = {"name": "conditional"}
    config = parse_app_config(args)
    settings = config.ingress_settings()
    members = []
    for pool_config in config.pools:
        role = pool_config.role
        prefix = "engine" if role == "mixed" else role
        for index in range(pool_config.replicas):
            state = EngineState()
            state.update_engine(_stats(f"{prefix}-{index}", role, rng))
            state.prefill_s_per_token.add(rng.uniform(1e-5, 5e-5))
            state.step_s.add(rng.uniform(0.01, 0.03))
            members.append(PooledEngine(f"{prefix}-{index}", role, _Link(), 1.0, state))
    kv = _RouterSide() if shape in ("pd", "auto") else None
    pool = EnginePool(members)
    return Dispatcher(settings, pool, kv), AdmissionControl(settings.qos), pool


class _RouterSide(PlainRouterSide):
    """The KV backend's router side as the plan sees it: nothing is handed over here."""

    def prefill_params(self, consumer: str | None) -> dict[str, Any]:
        return {}

    def decode_params(self, handle: dict[str, Any] | None) -> dict[str, Any]:
        return {}


def _stats(name: str, role: EngineRole, rng: random.Random) -> EngineStats:
    running = rng.choice(RUNNING)
    return EngineStats(
        replica=name,
        role=role,
        num_running=running,
        num_waiting=rng.randrange(0, 4),
        kv_cache_usage=rng.random(),
        block_size=BLOCK_SIZE,
        kv_capacity_blocks=4096,
    )


# How many engines hold each prompt's blocks: a fleet that routes by prefix keeps a
# prefix on a few engines, however many it has (prefix_affinity's point).
HOLDERS_PER_PROMPT = 2


def cache_prompts(pool: EnginePool, prompts: list[list[int]], rng: random.Random) -> None:
    """Every engine sends KV events (the default prefix signal), and each prompt is held by
    HOLDERS_PER_PROMPT engines: a prefix-aware decision finds hits, as on a fleet that has
    served for a while."""
    engines = list(pool)
    for engine in engines:  # every engine's events have arrived, held blocks or not
        engine.state.apply_cache_update(CacheUpdate(stored=[], removed=[]))
    for prompt in prompts:
        blocks = PromptBlocks(prompt).hashes(BLOCK_SIZE)
        for engine in rng.sample(engines, k=min(HOLDERS_PER_PROMPT, len(engines))):
            stored: list[tuple[bytes | int, int]] = [(h, h) for h in blocks]
            engine.state.apply_cache_update(CacheUpdate(stored=stored, removed=[]))


def measure(shape: str, engines: int, requests: int, choice: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    dispatcher, admission, pool = fleet(shape, engines, choice, rng)
    prompts = [[rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)] for _ in range(64)]
    cache_prompts(pool, prompts, rng)
    samples = []
    for index in range(requests):
        request = GenerateRequest(f"r{index}", "", prompts[index % len(prompts)], _Params())
        started = time.perf_counter()
        decide(dispatcher, admission, request)
        samples.append(time.perf_counter() - started)
    return {
        "shape": shape,
        "engines": engines,
        "requests": requests,
        "mean_us": 1e6 * statistics.fmean(samples),
        "p50_us": 1e6 * statistics.median(samples),
        "p99_us": 1e6 * sorted(samples)[int(0.99 * len(samples))],
    }


class _Params:
    """What the plan reads of a request's sampling parameters."""

    n = 1
    max_tokens = 128


def decide(dispatcher: Dispatcher, admission: AdmissionControl, request: GenerateRequest) -> None:
    """One request's decisions, and its prefill's bookkeeping from queued to finished."""
    priority: Priority = "normal"
    admission.check(
        priority, dispatcher.queued_requests, lambda: dispatcher.earliest_ttft_s(priority)
    )
    plan = dispatcher.plan(request, priority)
    estimate = plan.ttft_estimate_s()
    admission.check(priority, dispatcher.queued_requests, lambda: estimate)
    engine = plan.prefill_engine
    engine.state.record_prompt(plan.prompt)
    now = time.perf_counter()
    ticket = engine.state.enqueue_prefill(plan.prefill_tokens, now, 1)
    engine.state.enter_engine(ticket)
    engine.state.finish_prefill(ticket, now, first_token=False)


def _median_row(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(repeats[0])
    for key in ("mean_us", "p50_us", "p99_us"):
        row[key] = statistics.median(r[key] for r in repeats)
    row["p50_us_rounds"] = [r["p50_us"] for r in repeats]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="2,64,512")
    parser.add_argument("--shapes", default="dp,pd,auto")
    parser.add_argument("--choice", default="least_loaded")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved rounds; the table is their median"
    )
    parser.add_argument("--out", type=Path, default=Path("results/decision_cost"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cells = [(s, int(n)) for s in args.shapes.split(",") for n in args.engines.split(",")]
    # Rounds interleave the cells: this box's speed drifts by tens of percent between
    # minutes, and a drift must not land on one fleet size alone.
    rounds = [
        [
            measure(shape, engines, args.requests, args.choice, args.seed + r)
            for shape, engines in cells
        ]
        for r in range(args.repeats)
    ]
    rows = [_median_row([round_[i] for round_ in rounds]) for i in range(len(cells))]
    table = Table(
        title=f"router decisions per request, {args.choice}, this box (2 cores),"
        f" median of {args.repeats} rounds"
    )
    for column in ("shape", "engines", "mean us", "p50 us", "p99 us"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["shape"],
            str(row["engines"]),
            f"{row['mean_us']:.1f}",
            f"{row['p50_us']:.1f}",
            f"{row['p99_us']:.1f}",
        )
    console.print(table)
    path = args.out / "decision_cost.json"
    path.write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )
    console.print(f"saved {path}")


if __name__ == "__main__":
    main()
