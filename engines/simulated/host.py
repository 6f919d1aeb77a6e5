"""``engine.backend: simulated``: an engine that schedules as vLLM does and spends on
each step the time its latency profile gives, without a model.

It answers the router's protocol as a vLLM engine host does (engines/host.py): the same
submit, abort, delta stream, stats, and KV events for the router's prefix index, so that
every shape, policy, the autoscaler, the load generator and the dashboard run unchanged
on a GPU fleet's time. Tokens are stand-ins (the prompt's last token, again and again);
what is true is when they come. ``time_scale`` stretches every simulated time, so that
one box's router keeps up with many engines; reports divide it back out.

PD: a prefill engine's answer carries the prompt's token count as its KV handle; the
decode engine waits the profile's hand-over time for it, then computes the prompt's last
token only. No KV moves, but the decode engine reports each hand-over's bytes and time
as a vLLM engine's connector does (``EngineStats.kv_transfer``, one load per hand-over),
so that the router's cost policy weighs the link as it would on real engines.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engines.backends import ENGINE_BACKENDS
from engines.delta_streams import DeltaStreams
from engines.kv_events import chain_hashes
from engines.protocol import (
    CACHE_UPDATES,
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateRequest,
    LoraAdapter,
    TokenLogprobs,
)
from engines.settings import CPU_BIND_ENV, EngineSpec
from engines.simulated.cpu_spender import CpuSpender, bound_cores
from engines.simulated.frontend import FrontEnd
from engines.simulated.link import HandoverLink
from engines.simulated.metrics import SimulatedEngineMetrics
from engines.simulated.scheduler import (
    ScheduledStep,
    SchedulerLimits,
    SimRequest,
    SimScheduler,
)
from engines.simulated.settings import SIMULATED_KV_TOKENS, engine_profile, scheduler_limits
from kv_transfer.metrics import TransferTotals
from splitserve.latency.profile import LatencyProfile, StepTimes

logger = logging.getLogger("splitserve.engines")

# What every simulated token reads as: one byte, one token for the byte-level tokenizer.
SIMULATED_TEXT = "a"


@dataclass(slots=True)
class _Client:
    """What the router asked of a request beyond its timing."""

    subscriber: str
    token_id: int
    completions: int
    logprobs: bool
    prompt_logprobs: list[TokenLogprobs | None] | None
    handover: bool  # a PD prefill: its answer carries the KV handle


@ENGINE_BACKENDS.register("simulated")
class SimulatedEngineHost:
    """engines.host.EngineHost's calls, answered by vLLM's scheduling on a profile's time."""

    def __init__(self, spec: EngineSpec) -> None:
        self._spec = spec
        self.profile: LatencyProfile = engine_profile(spec)
        # A scaled pool's replicas share one spec (one name): the process tells them apart.
        self._step_times = StepTimes(self.profile, f"{spec.name}:{os.getpid()}")
        self.limits: SchedulerLimits = scheduler_limits(spec, self.profile)
        self._time_scale = spec.backend.time_scale
        self._link = HandoverLink(self.profile, self._time_scale)
        # spend: cpu computes each step on the engine's cores instead of sleeping it.
        self._spender = (
            CpuSpender(bound_cores(spec.process_env.get(CPU_BIND_ENV)))
            if spec.backend.spend == "cpu"
            else None
        )
        # The host's own work for each hand-over, beside the steps (a thread of its own
        # in the real path: puts, gets and the directory's messages float on any core).
        self._handover_spender = (
            CpuSpender(None)
            if spec.backend.spend == "cpu" and self.profile.handover_cpu_s > 0
            else None
        )
        self._handover_work: set[asyncio.Task[None]] = set()
        self._max_model_len = spec.model.max_model_len or self.profile.max_model_len
        self._scheduler = SimScheduler(self.limits)
        self._clients: dict[str, _Client] = {}
        # Requests still in the front end's input processing (request_overhead_s).
        self._front_end = FrontEnd(self.profile.request_overhead_s * self._time_scale)
        self._streams = DeltaStreams()
        self._work = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None
        self._prompt_tokens = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self._transfers = TransferTotals()
        # vLLM's metric names through Ray's metrics, where there is a Ray worker to export.
        self._metrics = SimulatedEngineMetrics(spec) if _in_ray() else None

    async def submit(self, request: GenerateRequest) -> None:
        params = request.sampling_params
        prompt = request.prompt_token_ids
        max_tokens = getattr(params, "max_tokens", None) or self._max_model_len - len(prompt)
        handle = (request.kv_transfer_params or {}).get(SIMULATED_KV_TOKENS)
        sim = SimRequest(
            request.request_id,
            prompt_tokens=len(prompt),
            max_tokens=max(1, max_tokens),
            block_hashes=chain_hashes(prompt, self.limits.block_size),
            priority=request.scheduling_priority() if self.limits.policy == "priority" else 0,
            arrival=time.monotonic(),
            kv_from_elsewhere=handle is not None,
            kv_ready=handle is None,
        )
        self._scheduler.check(sim)
        if request.request_id in self._clients:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self._clients[request.request_id] = _Client(
            request.subscriber,
            prompt[-1] if prompt else 0,
            completions=getattr(params, "n", 1) or 1,
            logprobs=getattr(params, "logprobs", None) is not None,
            prompt_logprobs=[None, *([_certain(t)] for t in prompt[1:])]
            if getattr(params, "prompt_logprobs", None) is not None
            else None,
            handover=bool((request.kv_transfer_params or {}).get("do_remote_decode")),
        )
        self._streams.outbox(request.subscriber)
        if self._metrics is not None:
            self._metrics.arrived(request.request_id)
        loop = asyncio.get_running_loop()
        if self._stepper is None:
            self._stepper = loop.create_task(self._step_forever())
        taken_in = loop.time()
        if self._front_end.intake_s > 0:
            # The front end's input processing, before the scheduler sees the request.
            taken_in = self._front_end.take(sim, taken_in)
            loop.call_at(taken_in, self._release, taken_in)
        else:
            self._admit(sim)
        if handle is not None:
            arrived = self._link.arrival(taken_in, int(handle))
            loop.call_at(arrived, self._kv_crossed, request.request_id)

    def _release(self, at: float) -> None:
        for request in self._front_end.release(at):
            self._admit(request)

    def _admit(self, request: SimRequest) -> None:
        self._scheduler.add(request)
        self._work.set()

    def _kv_crossed(self, request_id: str) -> None:
        """The KV has crossed the link; with spend: cpu the host then does its part."""
        if self._handover_spender is None:
            self._kv_arrived(request_id)
            return
        task = asyncio.get_running_loop().create_task(self._host_handover(request_id))
        self._handover_work.add(task)
        task.add_done_callback(self._handover_work.discard)

    async def _host_handover(self, request_id: str) -> None:
        assert self._handover_spender is not None
        await self._handover_spender.spend(self.profile.handover_cpu_s * self._time_scale)
        self._kv_arrived(request_id)

    def _kv_arrived(self, request_id: str) -> None:
        if not self._front_end.kv_arrived(request_id):
            self._scheduler.kv_arrived(request_id)
        self._work.set()

    async def abort(self, request_id: str) -> None:
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self._front_end.drop(request_id)
        self._scheduler.abort(request_id)
        self._clients.pop(request_id, None)
        if self._metrics is not None:
            self._metrics.forget(request_id)

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        if self._spec.kv_events:
            # A router's view of the cache starts whole; later changes follow it.
            stored = list(self._scheduler.blocks.cached_hashes())
            snapshot = CacheUpdate(stored=[(h, h) for h in stored], cleared=True)
            self._streams.outbox(subscriber).put_nowait((CACHE_UPDATES, snapshot))
        return self._streams.stream(subscriber, self._subscriber_gone)

    def _subscriber_gone(self, subscriber: str) -> None:
        for request_id, client in list(self._clients.items()):
            if client.subscriber == subscriber:
                self._drop(request_id)

    def close_streams(self) -> None:
        self._streams.close_all()

    @property
    def dead(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return simulated_stats(
            self._spec,
            self._scheduler,
            self._max_model_len,
            dict(self._prompt_tokens),
            self._transfers,
        )

    async def check_health(self) -> None:
        if self._stepper is not None and self._stepper.done() and not self._stepper.cancelled():
            error = self._stepper.exception()
            raise RuntimeError(f"simulated engine {self._spec.name} stopped: {error!r}")

    async def add_lora(self, adapter: LoraAdapter) -> None:
        return None  # its times do not depend on adapters

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        return None

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
        if self._spender is not None:
            self._spender.close()
        for task in self._handover_work:
            task.cancel()
        if self._handover_spender is not None:
            self._handover_spender.close()

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            step = self._scheduler.schedule()
            if step is None:
                self._work.clear()
                await self._work.wait()
                due = loop.time()
                continue
            # A multi-step group runs all its steps before anything is streamed.
            seconds = step_ends(self._step_times, step, step.steps)[-1] * self._time_scale
            if self._spender is not None:
                await self._spender.spend(seconds)
            else:
                # Steps follow each other on the profile's time, not on this loop's
                # delays: a late wake-up shortens the next wait instead of adding up.
                due = max(due, loop.time() - self._time_scale * self.profile.step_overhead_s)
                due += seconds
                await asyncio.sleep(max(0.0, due - loop.time()))
            self._emit(step)

    def _emit(self, step: ScheduledStep) -> None:
        if step.preempted:
            logger.debug("preempted %s", [r.request_id for r in step.preempted])
        result = self._scheduler.complete(step)
        finished = {request.request_id for request in result.finished}
        prompt_sources: dict[str, int] = {}
        for request in result.sampled:
            count = result.new_tokens[request.request_id]
            if request.output_tokens == count:  # its first tokens
                count_prompt_sources(request, self._prompt_tokens, prompt_sources)
                if request.kv_from_elsewhere:
                    record_handover(self._transfers, self.profile, request, self._time_scale)
            client = self._clients.get(request.request_id)
            if client is None:
                continue
            done = request.request_id in finished
            self._send(request, client, done, count)
            if done:
                del self._clients[request.request_id]
        if self._metrics is not None:
            self._metrics.step(
                self._scheduler, result.sampled, result.finished, prompt_sources, result.new_tokens
            )
        self._publish_cache_events()

    def _send(self, request: SimRequest, client: _Client, done: bool, count: int) -> None:
        """``count`` new tokens of ``request`` in one chunk per completion, as vLLM streams
        a step's (or a multi-step group's) tokens."""
        outbox = self._streams.outbox(client.subscriber)
        first = request.output_tokens == count
        kv_params = None
        if done and client.handover:
            kv_params = {SIMULATED_KV_TOKENS: request.prompt_tokens}
        for index in range(client.completions):
            chunk = GenerateChunk(
                token_ids=[client.token_id] * count,
                text=SIMULATED_TEXT * count,
                finish_reason="length" if done else None,
                num_prompt_tokens=request.prompt_tokens,
                num_cached_tokens=request.cached_tokens if first else 0,
                kv_transfer_params=kv_params,
                index=index,
                logprobs=[[_certain(client.token_id)] for _ in range(count)]
                if client.logprobs
                else None,
                prompt_logprobs=client.prompt_logprobs if first else None,
            )
            outbox.put_nowait((request.request_id, chunk))

    def _publish_cache_events(self) -> None:
        events = self._scheduler.blocks.take_events()
        if not self._spec.kv_events or not (events.stored or events.removed):
            return
        update = CacheUpdate(stored=[(h, h) for h in events.stored], removed=list(events.removed))
        self._streams.broadcast((CACHE_UPDATES, update))


def _in_ray() -> bool:
    import ray

    return bool(ray.is_initialized())


def step_ends(step_times: StepTimes, step: ScheduledStep, steps: int) -> list[float]:
    """When each of ``steps`` model steps of ``step`` ends, from its start: its shape's
    time, or for decodes (a run, a multi-step group) each step's, which reads one more
    token of context per request than the last."""
    if steps == 1:
        return [step_times.step(step.shape)]
    shape = step.shape
    return step_times.decode_run_ends(shape.decode_seqs, shape.decode_context_tokens, steps)


def simulated_stats(
    spec: EngineSpec,
    scheduler: SimScheduler,
    max_model_len: int,
    prompt_tokens: dict[str, int] | None = None,
    transfers: TransferTotals | None = None,
) -> EngineStats:
    """A simulated engine's load, as a vLLM engine host reports it to routers; decode
    engines of PD are named in prefill requests by their engine name."""
    return EngineStats(
        replica=spec.name,
        role=spec.role,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_unfinished=len(scheduler),
        kv_cache_usage=scheduler.blocks.usage,
        prefix_cache_queries=scheduler.prefix_queries,
        prefix_cache_hits=scheduler.prefix_hits,
        reported_at=time.time(),
        block_size=scheduler.limits.block_size,
        kv_capacity_blocks=scheduler.limits.num_blocks,
        prompt_tokens=prompt_tokens or {},
        kv_consumer=spec.name if spec.role == "decode" else None,
        max_model_len=max_model_len,
        kv_transfer=None
        if transfers is None or transfers.is_empty()
        else copy.deepcopy(transfers.data),
    )


def count_prompt_sources(request: SimRequest, *counts: dict[str, int]) -> None:
    """Where a prompt's tokens came from, as vLLM counts them, into each of ``counts``;
    once per request, at its first token."""
    cached = request.cached_tokens
    source = "external_kv_transfer" if request.kv_from_elsewhere else "local_cache_hit"
    for name, tokens in ((source, cached), ("local_compute", request.prompt_tokens - cached)):
        for count in counts:
            count[name] = count.get(name, 0) + tokens


def record_handover(
    transfers: TransferTotals, profile: LatencyProfile, request: SimRequest, time_scale: float
) -> None:
    """The hand-over of a request's prompt KV, counted at its first token as a vLLM
    engine's connector counts the load of the step that computes it (so the router reads
    its seconds with the prompt tokens it moved), as one load claimed: the profile's link
    time covers the whole move, so there is no put of its own."""
    tokens = request.prompt_tokens
    seconds = profile.handover_seconds(tokens) * time_scale
    transfers.observe("get", seconds, tokens * profile.kv_bytes_per_token, first_part=True)
    transfers.count_load("claimed")


def _certain(token_id: int) -> tuple[int, float, int | None, str | None]:
    """A stand-in token's logprobs: it was certain (rank 1, probability 1)."""
    return (token_id, 0.0, 1, None)
