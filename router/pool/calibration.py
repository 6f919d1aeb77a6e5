"""Seed the TTFT estimate before the first request: one timed prefill per engine.

Admission control estimates a request's time to first token from seconds per prefill
token measured on real first tokens. Without a measurement it could only admit
everything, and the first burst after a start (a deploy, a failover) is exactly the
one that needs shedding. So once every engine is up, and before the router admits
anything, each engine prefills ``qos.calibration_prompt_tokens`` random tokens and
decodes one more: the first sample of its per-token prefill time and its decode step,
measured the way every later request is (``PooledEngine.generate``). It doubles as the
engine's warm-up.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Iterable

from engines.protocol import GenerateRequest
from router.pool.pooled_engine import PooledEngine

logger = logging.getLogger("splitserve.router")
# Prefill, then one decode step: the step time's first sample too.
CALIBRATION_OUTPUT_TOKENS = 2


async def calibrate_ttft(engines: Iterable[PooledEngine], prompt_tokens: int, vocab: int) -> None:
    """One timed prefill of ``prompt_tokens`` random token ids on every engine, at once
    (each engine has its own cores or GPUs)."""
    if prompt_tokens <= 0:
        return
    rng = random.Random(0)
    await asyncio.gather(
        *(
            _calibrate(engine, [rng.randrange(vocab) for _ in range(prompt_tokens)])
            for engine in engines
        )
    )


async def _calibrate(engine: PooledEngine, prompt: list[int]) -> None:
    # Imported here: the offline simulation reads this module's constants without vLLM,
    # whose import costs seconds a run.
    from vllm import SamplingParams

    request = GenerateRequest(
        request_id=f"calibration-{uuid.uuid4().hex[:12]}",
        subscriber="",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(
            max_tokens=CALIBRATION_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True
        ),
    )
    async for _ in engine.generate(request, prefill_tokens=len(prompt)):
        pass
    state = engine.state
    logger.info(
        "%s calibrated: %.3f ms per prefill token, decode step %.1f ms",
        engine.name,
        1000 * (state.prefill_s_per_token.value or 0.0),
        1000 * (state.step_s.value or 0.0),
    )
