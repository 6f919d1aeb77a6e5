"""``python -m deployments.simulate``: an application's YAML on simulated engines, in
virtual time, as fast as the machine computes it.

The engines are the simulated backend's scheduler (engines/simulated/scheduler.py) on a
latency profile's time; the router is the router's own decision-making: its
``Dispatcher`` (engine choice, prefill policy, auto pool peers), ``AdmissionControl``
(QoS), and one ``EngineState`` per engine, fed as the router feeds them (prefill tickets,
first-token and step times, the engines' stats every ``router.stats_interval_s``, their
KV events). Only HTTP, tokenization and the relay of tokens are left out: they cost the
router, not the engines, and are the part a real-time run (deployments.serve --simulate)
measures.

Input: the requests as JSON lines (index, arrival offset, prompt token ids, max_tokens,
priority), as ``python -m loadgen simulate`` writes them; output: each request's outcome
and token times as JSON lines, which loadgen turns into a run's results.

    python -m deployments.simulate describe CONFIG --profile P
    python -m deployments.simulate run CONFIG --profile P --requests IN --out OUT
    python -m deployments.simulate worker      # many runs, a JSON job per stdin line
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec

from deployments.app import engine_names, engine_spec
from deployments.config import KV_SHAPES, AppConfig, load_application
from deployments.launcher import config_path, simulated_config
from engines.protocol import CacheUpdate, EngineStats, GenerateRequest
from engines.settings import EngineSpec
from engines.simulated.frontend import FrontEnd
from engines.simulated.host import (
    count_prompt_sources,
    record_handover,
    simulated_stats,
    step_ends,
)
from engines.simulated.link import HandoverLink
from engines.simulated.scheduler import (
    ScheduledStep,
    SimRequest,
    SimScheduler,
)
from engines.simulated.settings import engine_profile, scheduler_limits
from kv_transfer import make_kv_backend
from kv_transfer.metrics import TransferTotals
from router.dispatch import Dispatch, Dispatcher
from router.http.errors import OpenAIError, Rejection
from router.lifecycle import Lifecycle, RequestLife
from router.observation.metrics import RouterMetrics
from router.observation.requests import RequestMetrics
from router.policies.qos import ENGINE_PRIORITY, AdmissionControl
from router.pool.calibration import CALIBRATION_OUTPUT_TOKENS
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineState
from router.pool.pooled_engine import PooledEngine
from router.pool.prefix_index import PromptBlocks
from router.pool.stats_poller import TransferCostMeter, summed_transfer_totals, transferred_tokens
from router.settings import IngressSettings
from splitserve.latency.profile import LatencyProfile, StepTimes
from splitserve.offline_exchange import (
    Answer,
    Arrival,
    Description,
    Job,
    Outcome,
    RunSpeed,
    decode,
    encode,
    read_lines,
    write_lines,
)

# Stats polls in a row with requests open and no other event due before a run is
# declared stalled: far more than any legitimate wait between two events (a poll is
# the only thing due only while every engine is idle), small enough to fail in seconds.
STALLED_POLLS = 1000


class EventQueue:
    """Virtual time: callbacks by due time, ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.events = 0

    def at(self, due: float, callback: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._heap, (due, next(self._order), callback, args))

    @property
    def pending(self) -> int:
        return len(self._heap)

    def run(self, until: Callable[[], bool]) -> None:
        while self._heap and not until():
            due, _, callback, args = heapq.heappop(self._heap)
            self.now = due
            self.events += 1
            callback(*args)


class _NoLink:
    """The engine link of a simulated router's PooledEngine: the simulation calls the
    engine itself, so nothing may go through here."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"the offline simulation never calls an engine link ({name})")


class VirtualEngine:
    """One simulated engine in virtual time, and the router's view of it.

    A batch of decodes that nothing can join runs as one event for all its steps, until
    its first request finishes (``SimScheduler.decode_run_length``); a request that
    arrives meanwhile cuts the run short after the step in progress, where a real
    engine would take it in: after the multi-step group in progress, whose tokens all
    come at its end."""

    def __init__(self, spec: EngineSpec, client: PooledEngine, queue: EventQueue) -> None:
        self.name = spec.name
        self.spec = spec
        self.client = client
        self.profile: LatencyProfile = engine_profile(spec)
        self._step_times = StepTimes(self.profile, spec.name)
        self._link = HandoverLink(self.profile)
        self._front_end = FrontEnd(self.profile.request_overhead_s)
        self.limits = scheduler_limits(spec, self.profile)
        self.scheduler = SimScheduler(self.limits)
        self._queue = queue
        self._step: ScheduledStep | None = None
        self._single_steps = False
        self._started = 0.0
        self._ends: list[float] = []  # each step's end, from _started
        self._generation = 0  # an end event of an earlier generation was superseded
        self.busy_s = 0.0  # time spent in steps: the device's utilization, over the run
        # request id -> what to call with its new tokens' times (times, finished)
        self._listeners: dict[str, Callable[[list[float], bool], None]] = {}
        self._kv_events = spec.kv_events
        # What a real-time simulated engine reports of its prompts and hand-overs.
        self.prompt_tokens: dict[str, int] = {}
        self.transfers = TransferTotals()

    def time_steps_by(self, step_times: StepTimes) -> None:
        """Time every step by ``step_times`` (a replay's measured steps), one step an
        event: a run of decodes would ask for its steps' times before they start."""
        self._step_times = step_times
        self._single_steps = True

    def submit(self, request: SimRequest, on_tokens: Callable[[list[float], bool], None]) -> float:
        """Take ``request`` in; when the front end has (engines/simulated/frontend.py)."""
        self._listeners[request.request_id] = on_tokens
        taken_in = self._front_end.take(request, self._queue.now)
        self._queue.at(taken_in, self._release, taken_in)
        return taken_in

    def kv_arrives(self, request_id: str, tokens: int, taken_in: float) -> None:
        """A hand-over of ``tokens`` of KV for a request just submitted: it moves once the
        front end has taken the request in (``taken_in``), behind the link's earlier
        hand-overs."""
        self._queue.at(self._link.arrival(taken_in, tokens), self._kv_arrived, request_id)

    def _release(self, at: float) -> None:
        released = self._front_end.release(at)
        if released:
            for request in released:
                self.scheduler.add(request)
            self._cut_run()
            self._kick()

    def _kv_arrived(self, request_id: str) -> None:
        if self._front_end.kv_arrived(request_id):
            return  # the scheduler starts loading it when the front end releases it
        self.scheduler.kv_arrived(request_id)
        self._cut_run()
        self._kick()

    def _kick(self) -> None:
        if self._step is not None:
            return
        step = self.scheduler.schedule()
        if step is None:
            return
        steps = step.steps if self._single_steps else self.scheduler.decode_run_length(step)
        ends = step_ends(self._step_times, step, steps)
        self._step, self._started, self._ends = step, self._queue.now, ends
        self._generation += 1
        self._queue.at(self._started + ends[-1], self._done, self._generation)

    def _cut_run(self) -> None:
        """Something may join the batch: end the run after the step (the multi-step
        group) in progress."""
        ends = self._ends
        if self._step is None or len(ends) <= self._step.steps:
            return
        group = self._step.steps
        in_progress = bisect.bisect_right(ends, self._queue.now - self._started) + 1
        keep = -(-in_progress // group) * group
        if keep >= len(ends):
            return
        self._ends = ends[:keep]
        self._generation += 1
        self._queue.at(self._started + self._ends[-1], self._done, self._generation)

    def _done(self, generation: int) -> None:
        if generation != self._generation:
            return  # the run was cut short; its new end is another event
        step, ends = self._step, self._ends
        assert step is not None
        self._step = None
        self.busy_s += ends[-1]
        result = self.scheduler.complete_run(step, len(ends))
        finished = {request.request_id for request in result.finished}
        times = self._token_times(step.steps)
        for request in result.sampled:
            count = result.new_tokens[request.request_id]
            if request.output_tokens == count:  # its first tokens
                count_prompt_sources(request, self.prompt_tokens)
                if request.kv_from_elsewhere:
                    record_handover(self.transfers, self.profile, request, 1.0)
            done = request.request_id in finished
            listener = self._listeners.get(request.request_id)
            if done:
                self._listeners.pop(request.request_id, None)
            if listener is not None:
                listener(times if count == len(times) else times[:count], done)
        events = self.scheduler.blocks.take_events()
        if self._kv_events and (events.stored or events.removed):
            update = CacheUpdate(
                stored=[(h, h) for h in events.stored], removed=list(events.removed)
            )
            self.client.state.apply_cache_update(update)
        self._kick()

    def _token_times(self, group: int) -> list[float]:
        """When the run's tokens reach the caller, a step each: a multi-step group's all
        at its end."""
        started, ends = self._started, self._ends
        if group == 1:
            return [started + end for end in ends]
        return [started + ends[step // group * group + group - 1] for step in range(len(ends))]

    def stats(self) -> EngineStats:
        max_model_len = self.spec.model.max_model_len or self.profile.max_model_len
        return simulated_stats(
            self.spec, self.scheduler, max_model_len, dict(self.prompt_tokens), self.transfers
        )


class VirtualClock:
    """The router's clock (router/lifecycle.py ``RouterClock``) on the event queue's
    virtual time; nothing is given up by a deadline (no request times out offline)."""

    def __init__(self, queue: EventQueue) -> None:
        self._queue = queue

    def now(self) -> float:
        return self._queue.now

    def deadline(self, after_s: float) -> float | None:
        return None


class AlwaysReady:
    """Readiness offline: the engines are calibrated before the first arrival."""

    is_ready = True

    async def wait(self, timeout_s: float) -> bool:
        return True

    def starting_error(self, retry_after_s: float) -> OpenAIError:
        raise AssertionError("an offline cluster is ready before its first request")


def _uncounted(life: RequestLife) -> None:
    """Offline, a request's count is its outcome."""


class OfflineCluster:
    """One model's router over its simulated engines, in virtual time.

    Each request lives the router's own life (router/lifecycle.py) as far as it decides:
    a ``RequestLife`` enters the model's ``Lifecycle``, is admitted early and planned by
    it (the dispatcher and QoS), and its plan starts through the dispatcher, which
    records the prompt on its engines and names them; its engines' in-flight counts
    run from its start to its end, and each engine's stream is timed by the router's
    ``StreamTiming``. Calibration is the router's: one lone prefill and decode step of
    ``qos.calibration_prompt_tokens`` on every engine before the first arrival."""

    def __init__(self, config: AppConfig, path_s: float = 0.0) -> None:
        """``path_s``: what the serving path costs a request before the router plans it
        (HTTP, parsing, tokenization), which virtual time leaves out unless given."""
        self.settings: IngressSettings = config.ingress_settings()
        self.path_s = path_s
        self.queue = EventQueue()
        self.engines: dict[str, VirtualEngine] = {}
        for name, pool, index in engine_names(config):
            spec = engine_spec(config, name, pool, index)
            client = PooledEngine(name, pool.role, _NoLink(), 1.0, self._engine_state())
            self.engines[name] = VirtualEngine(spec, client, self.queue)
        self.pool = EnginePool([engine.client for engine in self.engines.values()])
        self.kv = None
        if config.shape in KV_SHAPES:
            self.kv = make_kv_backend(config.kv_transfer).router_side()
        # The hand-over's cost as the router's poller measures it, from the engines' stats.
        self.transfer_cost = TransferCostMeter(self.settings.qos.ema_weight)
        self._kv_polled_at = -math.inf
        self.dispatcher = Dispatcher(
            self.settings, self.pool, self.kv, self.transfer_cost.estimate_s
        )
        self.admission = AdmissionControl(self.settings.qos)
        self.clock = VirtualClock(self.queue)
        model = config.served_name
        self.lifecycle = Lifecycle(
            model,
            self.settings.router,
            self.dispatcher,
            self.admission,
            AlwaysReady(),
            RequestMetrics(
                RouterMetrics().for_model(model), config.shape, self.dispatcher, None, None
            ),
            self.clock,
        )
        self.outcomes: list[Outcome] = []
        self._open = 0
        self._next_poll: float | None = None  # the poll chain's next poll, while one runs
        self._idle_polls = 0
        # Virtual time at the end of calibration: arrivals and token times count from it.
        self.epoch = 0.0
        self._calibrate()

    def _engine_state(self) -> EngineState:
        qos, router = self.settings.qos, self.settings.router
        return EngineState(
            qos.ema_weight,
            qos.min_prefill_tokens_per_sample,
            kv_events_pending_s=router.kv_events_pending_s,
        )

    def _calibrate(self) -> None:
        """The router's calibration (router/pool/calibration.py): every engine at once
        prefills calibration_prompt_tokens and decodes one more token, timed as every
        later request is."""
        tokens = self.settings.qos.calibration_prompt_tokens
        if tokens > 0:
            rng = random.Random(0)
            calibration = Outcome(-1, 0.0)
            for engine in self.engines.values():
                prompt = [rng.randrange(1, 2**15) for _ in range(tokens)]
                blocks = PromptBlocks(prompt)
                arrival = Arrival(-1, 0.0, prompt, CALIBRATION_OUTPUT_TOKENS)
                self._open += 1
                if not self._generate(
                    engine.client, arrival, blocks, tokens, calibration, self._closed
                ):
                    raise ValueError(
                        f"{engine.name} cannot take qos.calibration_prompt_tokens ({tokens}):"
                        f" {calibration.error}"
                    )
            self._poll()
            self.queue.run(until=lambda: self._open == 0)
        self.epoch = self.queue.now
        self._next_poll = None  # the chain ends with calibration; the first arrival starts one
        self._poll()

    def _poll(self) -> None:
        """The router's stats poll, every stats_interval_s while requests are open (one
        chain of polls at a time; an idle cluster stops it, the next request restarts it)."""
        for engine in self.engines.values():
            engine.client.state.update_engine(engine.stats())
        now = self.queue.now
        if (
            self.kv is not None
            and now - self._kv_polled_at >= self.settings.router.kv_metrics_interval_s
        ):
            self._kv_polled_at = now
            totals = summed_transfer_totals(self.pool)
            if totals is not None:
                self.transfer_cost.update(totals, transferred_tokens(self.pool))
        self._check_progress()
        self._next_poll = None
        if self._open:
            due = self.queue.now + self.settings.router.stats_interval_s
            self._next_poll = due
            self.queue.at(due, self._poll_due, due)

    def _poll_due(self, due: float) -> None:
        if self._next_poll == due:  # else its chain ended and another began
            self._poll()

    def _check_progress(self) -> None:
        """Fail a run that can never end: requests open while the next poll is all that
        is left to happen, poll after poll (a request lost between the front end, the
        scheduler and a hand-over would otherwise poll forever)."""
        self._idle_polls = self._idle_polls + 1 if self._open and not self.queue.pending else 0
        if self._idle_polls > STALLED_POLLS:
            raise RuntimeError(
                f"offline run stalled at {self.queue.now:.3f} s: {self._open} requests open"
                f" and nothing left to happen for {STALLED_POLLS} stats polls"
            )

    def run(self, arrivals: list[Arrival]) -> list[Outcome]:
        for arrival in arrivals:
            self.queue.at(self.epoch + arrival.at + self.path_s, self._arrive, arrival)
        total = len(arrivals)
        self.queue.run(until=lambda: len(self.outcomes) == total and self._open == 0)
        return sorted(self.outcomes, key=lambda outcome: outcome.index)

    def _arrive(self, arrival: Arrival) -> None:
        outcome = Outcome(arrival.index, arrival.at, prompt_tokens=len(arrival.prompt))
        self.outcomes.append(outcome)
        life = RequestLife("offline", str(arrival.index), _uncounted, self.clock)
        self.lifecycle.enter(life, arrival.priority or self.settings.qos.default_priority, None)
        request = GenerateRequest(
            request_id=str(arrival.index),
            subscriber="",
            prompt_token_ids=arrival.prompt,
            sampling_params=SimpleNamespace(max_tokens=arrival.max_tokens, n=1),
        )
        try:
            life.admit_early()
            plan = life.plan(request)
        except Rejection as refused:
            outcome.status, outcome.outcome = int(refused.status), "rejected"
            outcome.error = refused.reason
            return
        dispatch = self.dispatcher.start(plan)
        outcome.headers = dispatch.response_headers()
        outcome.prefill = f"{plan.decision.where}:{plan.decision.reason}"
        self._open += 1
        if self._next_poll is None:
            self._poll()
        self._start(dispatch, arrival, outcome)

    def _start(self, dispatch: Dispatch, arrival: Arrival, outcome: Outcome) -> None:
        """The dispatch's engine streams, its engines in flight until it ends (as a
        request's life counts them: router/lifecycle.py)."""
        for engine in dispatch.engines:
            engine.state.in_flight += 1

        def ended(now: float) -> None:
            for engine in dispatch.engines:
                engine.state.in_flight -= 1
            self._closed(now)

        plan = dispatch.plan
        main = plan.main.engine
        if plan.prefill is None:
            if not self._generate(main, arrival, plan.prompt, plan.prefill_tokens, outcome, ended):
                ended(self.queue.now)
            return

        def handed_over(now: float) -> None:
            if arrival.max_tokens <= 1 or not self._generate(
                main, arrival, plan.prompt, 0, outcome, ended, handed_over=True
            ):
                ended(now)

        started = self._generate(
            plan.prefill.engine,
            arrival,
            plan.prompt,
            plan.prefill_tokens,
            outcome,
            handed_over,
            prefill=True,
        )
        if not started:
            ended(self.queue.now)

    def _generate(
        self,
        pooled: PooledEngine,
        arrival: Arrival,
        prompt: PromptBlocks,
        prefill_tokens: int,
        outcome: Outcome,
        on_end: Callable[[float], None],
        prefill: bool = False,
        handed_over: bool = False,
    ) -> bool:
        """One engine's part of a request, timed as PooledEngine.generate times it;
        ``on_end`` is called at its end. False: the engine refused it (400), at once."""
        engine = self.engines[pooled.name]
        now = self.queue.now
        priority = self._engine_priority(arrival)
        timing = pooled.state.open_stream(prefill_tokens, now, priority)
        pooled.state.enter_engine(timing.ticket)
        block_size = engine.limits.block_size
        request = SimRequest(
            f"{arrival.index}-{pooled.name}",
            prompt_tokens=len(arrival.prompt),
            max_tokens=1 if prefill else arrival.max_tokens,
            # The router's plan hashed the prompt already, once per block size.
            block_hashes=prompt.hashes(block_size),
            priority=timing.ticket.priority,
            arrival=now,
            kv_from_elsewhere=handed_over,
            kv_ready=not handed_over,
        )
        epoch = self.epoch

        def on_tokens(times: list[float], done: bool) -> None:
            first = timing.last_token_at is None
            timing.run_tokens(times, done)
            # A handed-over request's first token was the prefill engine's.
            relayed = times[1:] if first and handed_over else times
            outcome.token_times.extend([time - epoch for time in relayed])
            if done:
                timing.closed(times[-1])
                on_end(times[-1])

        try:
            engine.scheduler.check(request)
        except ValueError as error:
            timing.closed(now)
            outcome.status, outcome.outcome, outcome.error = 400, "error", str(error)
            return False
        taken_in = engine.submit(request, on_tokens)
        if handed_over:
            engine.kv_arrives(request.request_id, len(arrival.prompt), taken_in)
        return True

    def _closed(self, now: float) -> None:
        self._open -= 1

    def _engine_priority(self, arrival: Arrival) -> int:
        return ENGINE_PRIORITY[arrival.priority or self.settings.qos.default_priority]


def simulated_application(config: str, profile: str, model: str | None = None) -> AppConfig:
    """The YAML's model (``model``: by served name; default the first) on simulated
    engines that keep ``profile``'s time."""
    application = load_application(simulated_config(config_path(config), profile))
    models = {entry.served_name: entry for entry in application.models}
    if model is None:
        return application.models[0]
    if model not in models:
        raise ValueError(f"{config} serves {sorted(models)}, not {model!r}")
    return models[model]


def describe(config: AppConfig) -> Description:
    """What a client would learn from GET /v1/models and the router's shape."""
    cluster_engine = next(iter(OfflineCluster(config).engines.values()))
    return Description(config.served_name, cluster_engine.stats().max_model_len, config.shape)


def read_arrivals(path: Path) -> list[Arrival]:
    return list(read_lines(path, Arrival))


def serve(config: AppConfig, arrivals: list[Arrival], out: Path, path_ms: float) -> RunSpeed:
    """Serve ``arrivals`` offline, write each outcome to ``out`` (JSON lines) and say how
    it went: virtual and wall seconds, each engine's busy share, events."""
    started = time.perf_counter()
    cluster = OfflineCluster(config, path_s=path_ms / 1000)
    outcomes = cluster.run(arrivals)
    elapsed = time.perf_counter() - started
    write_lines(out, outcomes)
    virtual = cluster.queue.now - cluster.epoch
    span = virtual - min((a.at for a in arrivals), default=0.0)
    return RunSpeed(
        utilization_pct={
            name: 100.0 * engine.busy_s / span if span > 0 else 0.0
            for name, engine in cluster.engines.items()
        },
        requests=len(arrivals),
        engines=len(cluster.engines),
        virtual_s=virtual,
        wall_s=elapsed,
        speedup=virtual / elapsed if elapsed else None,
        events=cluster.queue.events,
    )


class Worker:
    """Many runs in one process (``python -m deployments.simulate worker``): a search over
    layouts and rates runs hundreds, and each start of this module costs seconds of
    imports. Each job is a JSON line on stdin, each answer one on stdout.

    A job: ``config``, ``profile``, ``model`` (optional), ``requests`` (a requests file),
    ``out``, ``path_ms``, and optionally ``at``: arrival offsets of the file's first
    requests, in its order, replacing the file's; only those are served (the same
    prompts at another rate and length of run: the file is read once). The answer is
    ``serve``'s summary, or ``{"error": ...}``."""

    def __init__(self) -> None:
        self._applications: dict[tuple[str, float, str, str | None], AppConfig] = {}
        self._arrivals: dict[tuple[str, float], list[Arrival]] = {}

    def answer(self, job: Job) -> Answer:
        try:
            config = self._application(job.config, job.profile, job.model)
            arrivals = self._read(Path(job.requests))
            if job.at is not None:
                arrivals = _rescheduled(arrivals, job.at)
            return Answer(speed=serve(config, arrivals, Path(job.out), job.path_ms))
        except (ValueError, OSError) as error:
            return Answer(error=f"{type(error).__name__}: {error}")

    def _application(self, config: str, profile: str, model: str | None) -> AppConfig:
        # A YAML rewritten in place (a search run again in its folder) is read again.
        written = Path(config).stat().st_mtime if Path(config).exists() else 0.0
        key = (config, written, profile, model)
        if key not in self._applications:
            self._applications[key] = simulated_application(config, profile, model)
        return self._applications[key]

    def _read(self, path: Path) -> list[Arrival]:
        key = (str(path), path.stat().st_mtime)
        if key not in self._arrivals:
            self._arrivals = {key: read_arrivals(path)}  # one file at a time is kept
        return self._arrivals[key]


def _rescheduled(arrivals: list[Arrival], offsets: list[float]) -> list[Arrival]:
    """The first ``len(offsets)`` requests at those offsets (a shorter run serves fewer)."""
    if len(offsets) > len(arrivals):
        raise ValueError(f"{len(offsets)} arrival offsets for {len(arrivals)} requests")
    return [msgspec.structs.replace(a, at=at) for a, at in zip(arrivals, offsets, strict=False)]


def work(lines: Iterable[str], answer: Callable[[str], None]) -> None:
    worker = Worker()
    for line in lines:
        if line.strip():
            try:
                job = decode(line, Job)
            except msgspec.ValidationError as error:
                answer(encode(Answer(error=f"not a job: {error}")))
                continue
            answer(encode(worker.answer(job)))


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        work(sys.stdin, lambda text: print(text, flush=True))
        return 0
    parser = argparse.ArgumentParser(prog="python -m deployments.simulate", description=__doc__)
    parser.add_argument("command", choices=("describe", "run"))
    parser.add_argument("config", help="single, dp, pd, ... or a YAML path")
    parser.add_argument("--profile", required=True, help="a latency profile file or name")
    parser.add_argument("--model", help="the served model to simulate (default: the first)")
    parser.add_argument("--requests", type=Path, help="run: the requests, JSON lines")
    parser.add_argument("--out", type=Path, help="run: where the outcomes go, JSON lines")
    parser.add_argument(
        "--path-ms",
        type=float,
        default=0.0,
        help="run: what the serving path costs a request before it is planned (e.g. the"
        " TTFT of python -m loadgen profile against zero-time engines)",
    )
    args = parser.parse_args(argv)
    try:
        config = simulated_application(args.config, args.profile, args.model)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.command == "describe":
        print(encode(describe(config)))
        return 0
    if args.requests is None or args.out is None:
        parser.error("run needs --requests and --out")
    print(encode(serve(config, read_arrivals(args.requests), args.out, args.path_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
