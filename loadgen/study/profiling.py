"""``python -m loadgen profile``: measure one engine's step times over a grid and fit a
latency profile (splitserve/latency/) that simulated engines then keep.

Measured over HTTP from any OpenAI-compatible server that takes token-id prompts (bare
``vllm serve`` on a user's GPU, or our single.yaml on this box), one engine alone:
- prefill: one request at a time of each prompt length, ``max_tokens: 1``; its time to
  first token is the request's overhead plus one step of its prompt;
- decode: a batch of requests of one context length, started together; once all stream,
  the median gap between their tokens is one decode step of that batch, and every gap
  over that median tells how far steps spread around it (pooled over the grid).
Prompts are random token ids, different for every request, so the prefix cache never
hits. The server's KV capacity comes from vLLM's ``vllm:cache_config_info`` where its
/metrics has it, else from ``--kv-capacity-tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
from rich.table import Table

from splitserve.latency.fit import DecodeSample, PrefillSample, fit_steps, fitted_profile
from splitserve.latency.profile import LatencyProfile, StepShape

# Tokens a decode measurement skips at each stream's start: the batch's prefills run then.
SETTLE_TOKENS = 4
# The token ids prompts are drawn from: within every tokenizer's byte range.
TOKEN_RANGE = (10, 250)
# How many equally likely values describe the spread of a step's time around its median.
SPREAD_POINTS = 20


@dataclass(frozen=True)
class ProfileGrid:
    prompt_lengths: tuple[int, ...] = (16, 64, 256, 512, 1024)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (64, 512)
    decode_tokens: int = 48
    repeats: int = 3


@dataclass(frozen=True)
class ProfileTarget:
    base_url: str
    model: str
    headers: dict[str, str]


def _prompt(length: int, rng: random.Random) -> list[int]:
    return [rng.randint(*TOKEN_RANGE) for _ in range(length)]


async def _stream_times(
    session: aiohttp.ClientSession, target: ProfileTarget, prompt: list[int], max_tokens: int
) -> list[float]:
    """perf_counter() of the request's send, then of each streamed token event."""
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    times = [time.perf_counter()]
    url = f"{target.base_url}/v1/completions"
    async with session.post(url, json=body, headers=target.headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def _prefills(
    session: aiohttp.ClientSession, target: ProfileTarget, grid: ProfileGrid, rng: random.Random
) -> list[PrefillSample]:
    samples = []
    for length in grid.prompt_lengths:
        ttfts = []
        for _ in range(grid.repeats):
            times = await _stream_times(session, target, _prompt(length, rng), 1)
            ttfts.append(times[1] - times[0])
        samples.append(PrefillSample(length, statistics.median(ttfts)))
    return samples


async def _decode_step(
    session: aiohttp.ClientSession,
    target: ProfileTarget,
    batch: int,
    context: int,
    grid: ProfileGrid,
    rng: random.Random,
) -> tuple[DecodeSample, list[float]]:
    """One decode step of the batch (the median gap), and every gap over that median."""
    streams = await asyncio.gather(
        *(
            _stream_times(session, target, _prompt(context, rng), grid.decode_tokens)
            for _ in range(batch)
        )
    )
    # Only gaps after every stream's first SETTLE_TOKENS: then all of them decode.
    settled = max(times[1 + SETTLE_TOKENS] for times in streams)
    gaps = [
        later - earlier
        for times in streams
        for earlier, later in itertools.pairwise(times[1:])
        if earlier >= settled
    ]
    if not gaps:
        raise RuntimeError(f"batch {batch} x {context} tokens: no gap after the batch settled")
    # Mid-run, each request's context is its prompt and half its output.
    context_tokens = batch * (context + grid.decode_tokens // 2)
    median = statistics.median(gaps)
    # An engine that takes no time (a serving path's baseline) has no spread to speak of.
    ratios = [gap / median for gap in gaps] if median > 0 else []
    return DecodeSample(batch, context_tokens, median), ratios


@dataclass(frozen=True)
class Measurements:
    prefills: list[PrefillSample]
    decodes: list[DecodeSample]
    # Every decode gap over its batch's median step, pooled over the grid.
    gap_ratios: list[float]


@contextlib.asynccontextmanager
async def _warm_session(
    target: ProfileTarget, rng: random.Random
) -> AsyncIterator[aiohttp.ClientSession]:
    """A client session whose first request has warmed the server up."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await _stream_times(session, target, _prompt(32, rng), 4)
        yield session


async def measure(target: ProfileTarget, grid: ProfileGrid, seed: int = 0) -> Measurements:
    rng = random.Random(seed)
    async with _warm_session(target, rng) as session:
        prefills = await _prefills(session, target, grid, rng)
        decodes, ratios = [], []
        for context in grid.contexts:
            for batch in grid.batches:
                steps = []
                for _ in range(grid.repeats):
                    step, step_ratios = await _decode_step(
                        session, target, batch, context, grid, rng
                    )
                    steps.append(step)
                    ratios += step_ratios
                decodes.append(
                    DecodeSample(
                        batch,
                        steps[0].context_tokens,
                        statistics.median(s.seconds for s in steps),
                    )
                )
    return Measurements(prefills, decodes, ratios)


async def measure_prefills(
    target: ProfileTarget, grid: ProfileGrid, seed: int = 0
) -> list[PrefillSample]:
    """Lone prefills alone: through a PD application, they carry a hand-over each."""
    rng = random.Random(seed)
    async with _warm_session(target, rng) as session:
        return await _prefills(session, target, grid, rng)


def spread_quantiles(ratios: list[float], points: int = SPREAD_POINTS) -> list[float]:
    """``points`` equally likely values of a step's time over its median: the ratios'
    quantiles at the middles of ``points`` equal slices of probability."""
    return _quantiles(ratios, (np.arange(points) + 0.5) / points)


def gap_percentiles(ratios: list[float]) -> list[float]:
    """The ratios' percentiles 1 to 99, to read beside the profile."""
    return _quantiles(ratios, np.arange(1, 100) / 100)


def _quantiles(ratios: list[float], probabilities: np.ndarray) -> list[float]:
    if not ratios:
        return []
    return [round(float(q), 4) for q in np.quantile(np.asarray(ratios), probabilities)]


async def kv_capacity_tokens(target: ProfileTarget) -> int | None:
    """vLLM's KV cache size in tokens from its /metrics, where it exports it."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{target.base_url}/metrics", headers=target.headers) as response,
    ):
        if response.status != 200:
            return None
        text = await response.text()
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("vllm:cache_config_info") and "num_gpu_blocks" in labels:
                blocks, block_size = labels["num_gpu_blocks"], labels.get("block_size", "")
                if blocks.isdigit() and block_size.isdigit():
                    return int(blocks) * int(block_size)
    return None


def profile_from(
    prefills: list[PrefillSample],
    decodes: list[DecodeSample],
    source: str,
    **identity: object,
) -> LatencyProfile:
    fit = fit_steps(prefills, decodes)
    return fitted_profile(fit, source=source, **identity)


async def served_models(base_url: str, headers: dict[str, str]) -> list[tuple[str, int | None]]:
    """(id, max_model_len) of each model GET /v1/models lists."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url}/v1/models", headers=headers) as response,
    ):
        if response.status != 200:
            raise RuntimeError(f"{base_url}/v1/models answered {response.status}")
        cards = (await response.json())["data"]
    if not cards:
        raise RuntimeError(f"{base_url} serves no model")
    return [(card["id"], card.get("max_model_len")) for card in cards]


def save_samples(path: Path, measured: Measurements) -> None:
    """The measurements beside the profile, to fit again or to compare."""
    path.write_text(
        json.dumps(
            {
                "prefill": [dataclasses.asdict(sample) for sample in measured.prefills],
                "decode": [dataclasses.asdict(sample) for sample in measured.decodes],
                # Percentiles 1-99 of a decode gap over its batch's median step.
                "decode_gap_percentiles": gap_percentiles(measured.gap_ratios),
            },
            indent=1,
        )
    )


def profile_table(
    profile: LatencyProfile, prefills: list[PrefillSample], decodes: list[DecodeSample]
) -> Table:
    """Each measurement beside what the fitted profile predicts for it."""
    table = Table(title=f"{profile.device} / {profile.model}: measured and fitted")
    for column in ("kind", "tokens", "batch", "context", "measured ms", "fitted ms", "error"):
        table.add_column(column, justify="right")
    for sample in prefills:
        tokens = sample.prompt_tokens
        pairs = tokens * (tokens + 1) // 2
        shape = StepShape(prefill_tokens=tokens, attention_pairs=pairs, prefill_seqs=1)
        fitted = profile.request_overhead_s + profile.step_seconds(shape)
        table.add_row(*_row("prefill", tokens, 1, 0, sample.seconds, fitted))
    for decode in decodes:
        shape = StepShape(decode_seqs=decode.batch, decode_context_tokens=decode.context_tokens)
        fitted = profile.step_seconds(shape)
        table.add_row(
            *_row(
                "decode", decode.batch, decode.batch, decode.context_tokens, decode.seconds, fitted
            )
        )
    return table


def _row(
    kind: str, tokens: int, batch: int, context: int, measured: float, fitted: float
) -> list[str]:
    return [
        kind,
        str(tokens),
        str(batch),
        str(context),
        f"{measured * 1e3:.2f}",
        f"{fitted * 1e3:.2f}",
        f"{(fitted / measured - 1) * 100:+.1f}%",
    ]


def without_path_cost(
    prefills: list[PrefillSample], baseline_samples: Path
) -> tuple[list[PrefillSample], float]:
    """The prefill measurements less what the serving path costs alone (its lone-request
    TTFT on engines that take no time, per prompt length, from a profile run's saved
    samples), and that cost's median."""
    saved = json.loads(baseline_samples.read_text())["prefill"]
    cost = {int(sample["prompt_tokens"]): float(sample["seconds"]) for sample in saved}
    missing = sorted({s.prompt_tokens for s in prefills} - set(cost))
    if missing:
        raise ValueError(f"{baseline_samples} has no prefill of {missing} tokens")
    adjusted = [
        PrefillSample(s.prompt_tokens, max(s.seconds - cost[s.prompt_tokens], 1e-6))
        for s in prefills
    ]
    return adjusted, statistics.median(cost.values())
