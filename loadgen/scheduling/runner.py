"""One run end to end: discover the model, plan the requests, warm up, send on
schedule, collect every request's record and the server's view.

The send path is kept short on purpose: request bodies are built before
the first send, the sender only sleeps until the next scheduled time and starts
a task, and results are turned into figures when each request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from rich.console import Console

from loadgen.client.server_view import ServerView, ServerViewRecorder, discover_shape, parse_metrics
from loadgen.client.streaming import (
    ClientTimeouts,
    RequestRecord,
    SamplingOptions,
    StreamingClient,
    build_payload,
    request_headers,
)
from loadgen.config import RunConfig
from loadgen.data.recorded import PrefixedPrompts
from loadgen.data.workloads import (
    PROMPT_TOKEN_HIGH,
    PROMPT_TOKEN_LOW,
    RequestSize,
    TextCalibration,
    TextPrompts,
    TokenPrompts,
    WorkloadPlan,
    arrival_seed,
    plan_workload,
)
from loadgen.outputs.exposition import Exposition, RunMetrics
from loadgen.outputs.progress import RunProgress
from loadgen.outputs.stats import (
    RequestMetrics,
    RunSummary,
    ServiceLevel,
    request_metrics,
    run_duration,
    summarize_run,
)
from loadgen.scheduling.arrivals import (
    ArrivalProcess,
    RampUpArrivals,
    TraceReplayArrivals,
    format_qps,
    make_arrivals,
)

logger = logging.getLogger("loadgen.scheduling.runner")
PromptSource = TokenPrompts | TextPrompts | PrefixedPrompts

DEFAULT_CONTEXT_TOKENS = 4096
MAX_POOL_CONNECTIONS = 1024
WARMUP_CONCURRENCY = 4
START_LEAD_S = 0.02  # the schedule starts a moment after the sender does
SPIN_BELOW_S = 0.002  # the last stretch before a send is spent yielding, not sleeping
LIVE_TICK_S = 0.25
CHAT_PROBE_CHARS = (64, 512)
CONTROL_TIMEOUT_S = 10.0
READY_POLL_S = 1.0


class RunError(RuntimeError):
    """The run could not start: unreachable server, unusable workload."""


@dataclass
class RunResult:
    run_id: str
    config: RunConfig
    shape: str
    model: str
    max_model_len: int
    workload: WorkloadPlan
    qps_label: str
    arrivals: str
    started_at: str
    # ``time.perf_counter()`` at the run's time zero, which every request's ``*_s`` counts
    # from: lines our requests up with another client's on the same host.
    clock_origin_s: float
    summary: RunSummary
    server: ServerView
    requests: list[RequestMetrics]
    chat_calibration: TextCalibration | None = None
    notes: list[str] = field(default_factory=list)
    # ``time.time()`` at ``clock_origin_s``: wall-clock times of the run's events.
    wall_origin_s: float = math.nan
    model_root: str | None = None  # the model card's ``root`` (vLLM's model_id), if any


# Each request's record and its encoded body, built before the first send.
PreparedItems = list[tuple[RequestRecord, bytes]]


@dataclass(frozen=True)
class PreparedRun:
    plan: WorkloadPlan
    warmups: PreparedItems
    items: PreparedItems
    arrivals: ArrivalProcess
    schedule: list[float]
    calibration: TextCalibration | None


@dataclass(frozen=True)
class Endpoint:
    model: str
    max_model_len: int
    root: str | None = None


async def discover_endpoint(http: httpx.AsyncClient, config: RunConfig) -> Endpoint:
    """The served model and its context, from ``GET /v1/models`` unless given."""
    cards = await _model_cards(http, config)
    if not cards and config.model is None:
        raise RunError(f"{config.base_url}/v1/models lists no model; pass --model")
    card = next((c for c in cards if c.get("id") == config.model), cards[0] if cards else {})
    model = config.model or card["id"]
    max_model_len = config.max_model_len or card.get("max_model_len")
    if not max_model_len:
        logger.warning("the server does not say its context; assuming %d", DEFAULT_CONTEXT_TOKENS)
        max_model_len = DEFAULT_CONTEXT_TOKENS
    return Endpoint(model, int(max_model_len), card.get("root") if card else None)


async def _model_cards(http: httpx.AsyncClient, config: RunConfig) -> list[dict[str, Any]]:
    """``GET /v1/models``, asked again until it answers or ``ready_timeout_s`` is up."""
    deadline = time.monotonic() + config.ready_timeout_s
    while True:
        try:
            response = await http.get(f"{config.base_url}/v1/models", timeout=CONTROL_TIMEOUT_S)
            response.raise_for_status()
            return response.json().get("data") or []
        except (httpx.HTTPError, ValueError) as error:
            if time.monotonic() >= deadline:
                message = f"cannot list models at {config.base_url}/v1/models: {error}"
                raise RunError(message) from error
        await asyncio.sleep(READY_POLL_S)


def pool_size(config: RunConfig) -> int:
    """Connections the client may open: the concurrency the run can reach."""
    if config.max_concurrency is not None:
        return max(config.max_concurrency, WARMUP_CONCURRENCY)
    return max(min(config.num_requests, MAX_POOL_CONNECTIONS), WARMUP_CONCURRENCY)


def run_identifier(config: RunConfig, shape: str) -> str:
    rate = "replay" if config.workload.is_replay else f"qps{format_qps(config.qps)}"
    if config.ramp_up is not None:
        rate = config.ramp_up.label
    name = config.run_name or f"{shape}-{config.workload.label}-{rate}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def service_level(config: RunConfig) -> ServiceLevel:
    """The run's objectives, in seconds."""
    targets = (config.slo_ttft_ms, config.slo_tpot_ms, config.slo_e2el_ms)
    return ServiceLevel(*(None if ms is None else ms / 1000 for ms in targets))


def arrival_process(config: RunConfig, plan: WorkloadPlan) -> ArrivalProcess:
    if plan.trace_arrivals is not None:
        return TraceReplayArrivals(plan.trace_arrivals, config.workload.time_scale)
    if (ramp := config.ramp_up) is not None:
        seed = arrival_seed(config.seed)
        return RampUpArrivals(ramp.strategy, ramp.start_rps, ramp.end_rps, config.burstiness, seed)
    return make_arrivals(
        config.qps, config.arrival_process, arrival_seed(config.seed), config.burstiness
    )


class ScheduledSender:
    """Sends prepared requests at their scheduled times, at most ``max_concurrency`` at once."""

    def __init__(
        self,
        client: StreamingClient,
        max_concurrency: int | None,
        on_sent: Callable[[], None],
        on_done: Callable[[RequestRecord], None],
    ) -> None:
        self._client = client
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._on_sent = on_sent
        self._on_done = on_done

    async def run(
        self,
        items: PreparedItems,
        schedule: list[float],
        start: float,
    ) -> None:
        """Send item i at ``start + schedule[i]`` (``perf_counter`` seconds)."""
        tasks: set[asyncio.Task[None]] = set()
        for (record, payload), offset in zip(items, schedule, strict=True):
            await _sleep_until(start + offset)
            if self._slots is not None:
                await self._slots.acquire()
            record.scheduled_at = start + offset
            task = asyncio.create_task(self._send(record, payload))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _send(self, record: RequestRecord, payload: bytes) -> None:
        self._on_sent()
        try:
            await self._client.send(payload, record)
        finally:
            if self._slots is not None:
                self._slots.release()
        self._on_done(record)


async def _sleep_until(deadline: float) -> None:
    """Timers have millisecond granularity (uvloop rounds): sleep, then yield to the end."""
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay if delay > SPIN_BELOW_S else 0)


class Run:
    """State of one run while it executes."""

    def __init__(self, config: RunConfig, console: Console, exposition: Exposition | None) -> None:
        self.config = config
        self.console = console
        self.exposition = exposition
        headers = request_headers(config.headers)
        self.client = StreamingClient(
            config.base_url,
            config.endpoint,
            pool_size(config),
            ClientTimeouts(
                config.connect_timeout_s, config.read_timeout_s, config.request_timeout_s
            ),
            path=config.endpoint_path,
            headers=headers,
            verify_tls=config.verify_tls,
        )
        # The same headers on /v1/models and /metrics: a server that wants a key for
        # generation wants it there too.
        self.control = httpx.AsyncClient(
            timeout=CONTROL_TIMEOUT_S, headers=headers, verify=config.verify_tls
        )
        self.sampling = SamplingOptions(
            temperature=config.temperature,
            ignore_eos=config.ignore_eos,
            return_token_ids=config.return_token_ids,
            extra=config.extra_body,
        )
        self.notes: list[str] = []
        self.clock_origin = math.nan
        self.wall_origin = math.nan

    async def close(self) -> None:
        await self.client.aclose()
        await self.control.aclose()

    async def execute(self) -> RunResult:
        config = self.config
        endpoint = await discover_endpoint(self.control, config)
        prepared = await self.prepare_run(endpoint)
        warmup_metrics = await self._warm_up(prepared.warmups)
        recorder = ServerViewRecorder(
            self.control,
            f"{config.base_url}/metrics",
            config.server_sample_interval_s,
            config.prometheus_url,
        )
        shape = config.shape or await self._discover_shape(recorder, endpoint.model) or "unknown"
        run_id = run_identifier(config, shape)
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        metrics, server = await self._measure(prepared, recorder, run_id, shape)
        return self.result(
            shape, endpoint, prepared, metrics, server, started_at, warmups=warmup_metrics
        )

    def result(
        self,
        shape: str,
        endpoint: Endpoint,
        prepared: PreparedRun,
        metrics: list[RequestMetrics],
        server: ServerView,
        started_at: str,
        warmups: list[RequestMetrics] | None = None,
    ) -> RunResult:
        """The run's result from its measured requests (``warmups`` are kept apart)."""
        config = self.config
        return RunResult(
            run_id=run_identifier(config, shape),
            config=config,
            shape=shape,
            model=endpoint.model,
            max_model_len=endpoint.max_model_len,
            workload=prepared.plan,
            qps_label=prepared.arrivals.label
            if prepared.plan.trace_arrivals is not None or config.ramp_up is not None
            else format_qps(config.qps),
            arrivals=type(prepared.arrivals).__name__,
            started_at=started_at,
            clock_origin_s=self.clock_origin,
            summary=summarize_run(metrics, run_duration(metrics), self.service_level()),
            server=server,
            requests=(warmups or []) + metrics,
            chat_calibration=prepared.calibration,
            notes=self.notes,
            wall_origin_s=self.wall_origin,
            model_root=endpoint.root,
        )

    async def _measure(
        self, prepared: PreparedRun, recorder: ServerViewRecorder, run_id: str, shape: str
    ) -> tuple[list[RequestMetrics], ServerView]:
        config = self.config
        plan = prepared.plan
        live = None
        if self.exposition is not None:
            live = self.exposition.for_run(run_id, shape, plan.label, config.qps)
        if config.server_metrics:
            await recorder.start()
        title = f"{shape} {plan.label} {prepared.arrivals.label}"
        metrics = await self._send_all(prepared.items, prepared.schedule, live, title)
        if not config.server_metrics:
            return metrics, ServerView(notes=["server metrics not scraped (--no-server-metrics)"])
        await recorder.stop()
        return metrics, await recorder.view()

    def service_level(self) -> ServiceLevel:
        return service_level(self.config)

    # ---- preparation -----------------------------------------------------------------------

    async def prepare_run(self, endpoint: Endpoint) -> PreparedRun:
        """Every request body, and the schedule, before the first send."""
        config = self.config
        plan = plan_workload(
            config.workload,
            config.num_requests,
            config.warmup_requests,
            config.seed,
            endpoint.max_model_len,
        )
        needs_calibration = any(size.text is None for size in plan.sizes)
        calibration = await self._chat_calibration(endpoint.model) if needs_calibration else None
        prompts = self._prompt_source(calibration, plan.prefix_block_tokens)
        arrivals = arrival_process(config, plan)
        items = self._prepare(plan.sizes, endpoint.model, prompts, warmup=False)
        return PreparedRun(
            plan=plan,
            warmups=self._prepare(plan.warmup_sizes, endpoint.model, prompts, warmup=True),
            items=items,
            arrivals=arrivals,
            schedule=arrivals.schedule(len(items)),
            calibration=calibration,
        )

    async def _chat_calibration(self, model: str) -> TextCalibration | None:
        """Chat prompts are text: measure how the server counts our text, template included."""
        if self.config.endpoint != "chat":
            return None
        text = TextPrompts(self.config.seed)
        probes = []
        for chars in CHAT_PROBE_CHARS:
            record = RequestRecord(index=-1, input_len=chars, output_len=1, warmup=True)
            payload = build_payload("chat", model, text.text(chars), 1, self.sampling)
            await self.client.send(self.client.prepare(payload), record)
            if record.prompt_tokens is None:
                self.notes.append("chat prompts uncalibrated: the server reports no usage")
                return TextCalibration()
            probes.append((chars, record.prompt_tokens))
        return TextCalibration.from_probes(probes[0], probes[1])

    def _prompt_source(
        self, calibration: TextCalibration | None, prefix_block_tokens: int | None
    ) -> PromptSource:
        if self.config.endpoint == "chat":
            if prefix_block_tokens is not None:
                raise ValueError(
                    f"{self.config.workload.label} shares prompt prefixes as token ids:"
                    " send it to /v1/completions, not /v1/chat/completions"
                )
            return TextPrompts(self.config.seed, calibration)
        if prefix_block_tokens is not None:  # a recorded replay: its prefixes shared again
            return PrefixedPrompts(
                self.config.seed, prefix_block_tokens, PROMPT_TOKEN_LOW, PROMPT_TOKEN_HIGH
            )
        return TokenPrompts(self.config.seed)

    def _prepare(
        self,
        sizes: list[RequestSize],
        model: str,
        prompts: PromptSource,
        warmup: bool,
    ) -> PreparedItems:
        config = self.config
        # Warm-ups go to the base model without ids, as vLLM's client sends its own.
        models = [model] * len(sizes) if warmup else self._models(model, len(sizes))
        items = []
        for index, size in enumerate(sizes):
            payload = build_payload(
                config.endpoint,
                models[index],
                _prompt(prompts, size),
                size.output_len,
                self.sampling,
            )
            record = RequestRecord(
                index=index, input_len=size.input_len, output_len=size.output_len, warmup=warmup
            )
            if config.request_id_prefix is not None and not warmup:
                record.request_id = f"{config.request_id_prefix}{index}"
            items.append((record, self.client.prepare(payload)))
        return items

    def _models(self, model: str, count: int) -> list[str]:
        """The model each measured request names: ``model``, or one of the LoRA modules
        (at random from ``--seed``, or in turn)."""
        modules = self.config.lora_modules
        if not modules:
            return [model] * count
        if self.config.lora_assignment == "round-robin":
            return [modules[i % len(modules)] for i in range(count)]
        pick = random.Random(self.config.seed)
        return [pick.choice(modules) for _ in range(count)]

    async def _discover_shape(self, recorder: ServerViewRecorder, model: str) -> str | None:
        text = await recorder.scrape_text()
        with contextlib.suppress(ValueError):
            return discover_shape(parse_metrics(text), model) if text else None
        return None

    # ---- sending -------------------------------------------------------------------------

    async def _warm_up(self, items: PreparedItems) -> list[RequestMetrics]:
        if not items:
            return []
        slots = asyncio.Semaphore(WARMUP_CONCURRENCY)
        start = time.perf_counter()

        async def one(record: RequestRecord, payload: bytes) -> None:
            async with slots:
                record.scheduled_at = time.perf_counter()
                await self.client.send(payload, record)

        await asyncio.gather(*(one(record, payload) for record, payload in items))
        failed = sum(record.outcome != "ok" for record, _ in items)
        if failed:
            self.notes.append(f"{failed} of {len(items)} warm-up requests failed")
        return [request_metrics(record, start) for record, _ in items]

    async def _send_all(
        self,
        items: PreparedItems,
        schedule: list[float],
        live: RunMetrics | None,
        title: str,
    ) -> list[RequestMetrics]:
        done: list[RequestMetrics] = []
        progress = RunProgress(title, len(items), self.console, self.config.show_progress)

        def on_sent() -> None:
            progress.request_sent()
            if live is not None:
                live.request_sent(progress.sent, progress.in_flight)

        def on_done(record: RequestRecord) -> None:
            if scale != 1.0:
                unscale(record, run_start, scale)
            metrics = request_metrics(record, run_start)
            done.append(metrics)
            progress.request_done(metrics.outcome, metrics.ttft_s)
            if live is not None:
                live.request_done(metrics, progress.in_flight)

        scale = self.config.engine_time_scale
        schedule = [at * scale for at in schedule]
        sender = ScheduledSender(self.client, self.config.max_concurrency, on_sent, on_done)
        run_start = self.clock_origin = time.perf_counter() + START_LEAD_S
        self.wall_origin = time.time() + START_LEAD_S
        with progress:
            ticker = asyncio.create_task(_tick(progress, live))
            try:
                await sender.run(items, schedule, run_start)
            finally:
                ticker.cancel()
        return sorted(done, key=lambda m: m.index)


def unscale(record: RequestRecord, run_start: float, scale: float) -> None:
    """A record of a run against engines ``scale`` times slower, in their own time: every
    instant's distance from the run's start divided by ``scale``."""

    def own(at: float) -> float:
        return run_start + (at - run_start) / scale

    record.scheduled_at = own(record.scheduled_at)
    record.sent_at = own(record.sent_at)
    record.done_at = own(record.done_at)
    record.chunk_times = [own(at) for at in record.chunk_times]
    record.event_times = [own(at) for at in record.event_times]


def _prompt(prompts: PromptSource, size: RequestSize) -> list[int] | str:
    if size.text is not None:
        return size.text
    if isinstance(prompts, PrefixedPrompts):
        return prompts.prompt(size)
    return prompts.prompt(size.input_len)


async def _tick(progress: RunProgress, live: RunMetrics | None) -> None:
    while True:
        await asyncio.sleep(LIVE_TICK_S)
        progress.refresh()
        if live is not None and (p50 := progress.live_ttft_p50()) is not None:
            live.live_ttft_p50(p50)


async def execute_run(
    config: RunConfig, console: Console, exposition: Exposition | None = None
) -> RunResult:
    """Run one configuration and return every request's record and the summary."""
    run = Run(config, console, exposition)
    try:
        return await run.execute()
    finally:
        await run.close()
