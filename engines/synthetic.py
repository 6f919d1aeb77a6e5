"""An engine host without a model: it emits tokens as fast as its steps allow.

The router's relay path (submit, the per-subscriber delta stream, the SSE writer) is
the same for it as for a vLLM engine, so ``engine_backend: synthetic`` measures what
one router replica can relay when the engines are not the bottleneck
(bench/relay_capacity.py). Each step gives every running request one token, as a
decode step of a continuous-batching engine does; ``engine.step_interval_s`` paces
the steps (0: back to back, yielding to the event loop between them), and
``engine.max_num_seqs`` caps how many requests a step serves, so that a queue forms
under load as in a real engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engines.backends import ENGINE_BACKENDS
from engines.delta_streams import DeltaStreams
from engines.protocol import (
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    LoraAdapter,
    TokenLogprobs,
)
from engines.settings import EngineSpec

# What every synthetic token reads as: one byte, one token for the byte-level tokenizer.
SYNTHETIC_TEXT = "a"
DEFAULT_MAX_TOKENS = 16


@dataclass(slots=True)
class _Running:
    subscriber: str
    remaining: int
    num_prompt_tokens: int
    token_id: int
    completions: int = 1  # the request's n
    logprobs: bool = False
    # Sent with the first step, where the request asked for them.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@ENGINE_BACKENDS.register("synthetic")
class SyntheticEngineHost:
    """The calls of engines.host.EngineHost, answered by a token generator."""

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self._step_interval_s = self._spec.backend.step_interval_s
        self._max_num_seqs = self._spec.backend.max_num_seqs
        self._streams = DeltaStreams()
        self._running: dict[str, _Running] = {}
        self._work = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None
        self._steps = 0

    async def submit(self, request: GenerateRequest) -> None:
        if request.request_id in self._running:
            raise ValueError(f"request id {request.request_id!r} is already running")
        max_tokens = getattr(request.sampling_params, "max_tokens", None) or DEFAULT_MAX_TOKENS
        self._streams.outbox(request.subscriber)
        params = request.sampling_params
        prompt = request.prompt_token_ids
        self._running[request.request_id] = _Running(
            request.subscriber,
            max_tokens,
            len(prompt),
            prompt[-1] if prompt else 0,
            completions=getattr(params, "n", 1) or 1,
            logprobs=getattr(params, "logprobs", None) is not None,
            prompt_logprobs=[None, *([_certain(t)] for t in prompt[1:])]
            if getattr(params, "prompt_logprobs", None) is not None
            else None,
        )
        if self._stepper is None:
            self._stepper = asyncio.get_running_loop().create_task(self._step_forever())
        self._work.set()

    async def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        return self._streams.stream(subscriber, self._subscriber_gone)

    def _subscriber_gone(self, subscriber: str) -> None:
        for request_id, running in list(self._running.items()):
            if running.subscriber == subscriber:
                del self._running[request_id]

    def close_streams(self) -> None:
        self._streams.close_all()

    @property
    def dead(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        unfinished = len(self._running)
        running = min(unfinished, self._max_num_seqs) if self._max_num_seqs else unfinished
        return EngineStats(
            replica=self._spec.name,
            role=self._spec.role,
            num_running=running,
            num_waiting=unfinished - running,
            num_unfinished=unfinished,
            reported_at=time.time(),
        )

    async def check_health(self) -> None:
        return None

    async def add_lora(self, adapter: LoraAdapter) -> None:
        return None  # its tokens do not depend on weights

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        return None

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()

    async def _step_forever(self) -> None:
        while True:
            if not self._running:
                self._work.clear()
                await self._work.wait()
            self._step()
            # Back to back or paced: either way the loop serves HTTP between steps.
            await asyncio.sleep(self._step_interval_s)

    def _step(self) -> None:
        self._steps += 1
        batch = list(self._running.items())  # oldest first: dicts keep insertion order
        if self._max_num_seqs:
            batch = batch[: self._max_num_seqs]
        for request_id, running in batch:
            running.remaining -= 1
            finished = running.remaining <= 0
            outbox = self._streams.outbox(running.subscriber)
            if finished:
                del self._running[request_id]
            for index in range(running.completions):
                chunk = GenerateChunk(
                    token_ids=[running.token_id],
                    text=SYNTHETIC_TEXT,
                    finish_reason="length" if finished else None,
                    num_prompt_tokens=running.num_prompt_tokens,
                    index=index,
                    logprobs=[[_certain(running.token_id)]] if running.logprobs else None,
                    prompt_logprobs=running.prompt_logprobs,
                )
                outbox.put_nowait((request_id, chunk))
            running.prompt_logprobs = None


def _certain(token_id: int) -> tuple[int, float, int | None, str | None]:
    """A synthetic token's logprobs: it was certain (rank 1, probability 1)."""
    return (token_id, 0.0, 1, None)
