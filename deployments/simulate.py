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
import dataclasses
import heapq
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
from router.dispatch import Dispatcher, Plan
from router.http.errors import REFUSAL_STATUS
from router.policies.qos import ENGINE_PRIORITY, AdmissionControl
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineState
from router.pool.pooled_engine import PooledEngine
from router.pool.prefix_index import PromptBlocks
from router.pool.stats_poller import TransferCostMeter, summed_transfer_totals, transferred_tokens
from router.settings import IngressSettings, Priority
from splitserve.latency.profile import LatencyProfile, StepShape, StepTimes

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


@dataclass(slots=True)
class Outcome:
    """What a client saw of one request."""

    index: int
    arrival_s: float
    status: int = 200
    outcome: str = "ok"
    error: str | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "status": self.status,
            "outcome": self.outcome,
            "error": self.error,
            "token_times": self.token_times,
            "prompt_tokens": self.prompt_tokens,
            "prefill": self.prefill,
        }


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
        steps = self.scheduler.decode_run_length(step)
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


@dataclass(frozen=True, slots=True)
class Arrival:
    index: int
    at: float
    prompt: list[int]
    max_tokens: int
    priority: Priority | None = None


class OfflineCluster:
    """One model's router decisions over its simulated engines, in virtual time."""

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
        self.outcomes: list[Outcome] = []
        self._open = 0
        self._polling = False
        self._idle_polls = 0
        self._calibrate()
        self._poll()

    def _engine_state(self) -> EngineState:
        qos, router = self.settings.qos, self.settings.router
        return EngineState(
            qos.ema_weight,
            qos.min_prefill_tokens_per_sample,
            kv_events_pending_s=router.kv_events_pending_s,
        )

    def _calibrate(self) -> None:
        """What the router's calibration measures before it admits anything: one lone
        prefill of calibration_prompt_tokens on each engine (router/pool/calibration.py)."""
        tokens = self.settings.qos.calibration_prompt_tokens
        for engine in self.engines.values():
            pairs = tokens * (tokens + 1) // 2
            alone = engine.profile.request_overhead_s + engine.profile.step_seconds(
                StepShape(prefill_tokens=tokens, attention_pairs=pairs, prefill_seqs=1)
            )
            engine.client.state.prefill_s_per_token.add(alone / tokens)

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
        self._polling = bool(self._open)
        self._check_progress()
        if self._polling:
            self.queue.at(self.queue.now + self.settings.router.stats_interval_s, self._poll)

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
            self.queue.at(arrival.at + self.path_s, self._arrive, arrival)
        total = len(arrivals)
        self.queue.run(until=lambda: len(self.outcomes) == total and self._open == 0)
        return sorted(self.outcomes, key=lambda outcome: outcome.index)

    def _arrive(self, arrival: Arrival) -> None:
        outcome = Outcome(arrival.index, arrival.at, prompt_tokens=len(arrival.prompt))
        self.outcomes.append(outcome)
        priority = arrival.priority or self.settings.qos.default_priority
        request = GenerateRequest(
            request_id=str(arrival.index),
            subscriber="",
            prompt_token_ids=arrival.prompt,
            sampling_params=SimpleNamespace(max_tokens=arrival.max_tokens, n=1),
            priority=ENGINE_PRIORITY[priority],
        )
        dispatcher = self.dispatcher
        refusal = self.admission.check(
            priority, dispatcher.queued_requests, lambda: dispatcher.earliest_ttft_s(priority)
        )
        if refusal is None:
            plan = dispatcher.plan(request, priority)
            refusal = self.admission.check(
                plan.priority, dispatcher.queued_requests, plan.ttft_estimate_s
            )
        if refusal is not None:
            outcome.status, outcome.outcome = int(REFUSAL_STATUS[refusal.reason]), "rejected"
            outcome.error = refusal.reason
            return
        outcome.prefill = f"{plan.decision.where}:{plan.decision.reason}"
        self._open += 1
        if not self._polling:
            self._poll()
        self._start(plan, arrival, outcome)

    def _start(self, plan: Plan, arrival: Arrival, outcome: Outcome) -> None:
        main = plan.main.engine
        main.state.record_prompt(plan.prompt)
        if plan.prefill is None:
            self._generate(main, arrival, plan.prompt, plan.prefill_tokens, outcome, self._closed)
            return
        prefill = plan.prefill.engine
        prefill.state.record_prompt(plan.prompt)

        def handed_over(now: float) -> None:
            if arrival.max_tokens <= 1:
                self._closed(now)
                return
            self._generate(main, arrival, plan.prompt, 0, outcome, self._closed, handed_over=True)

        self._generate(
            prefill, arrival, plan.prompt, plan.prefill_tokens, outcome, handed_over, prefill=True
        )

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
    ) -> None:
        """PooledEngine.generate's bookkeeping around one engine's part of a request."""
        engine = self.engines[pooled.name]
        state = pooled.state
        now = self.queue.now
        pooled.state.in_flight += 1
        ticket = state.enqueue_prefill(prefill_tokens, now, self._engine_priority(arrival))
        state.enter_engine(ticket)
        block_size = engine.limits.block_size
        request = SimRequest(
            f"{arrival.index}-{pooled.name}",
            prompt_tokens=len(arrival.prompt),
            max_tokens=1 if prefill else arrival.max_tokens,
            # The router's plan hashed the prompt already, once per block size.
            block_hashes=prompt.hashes(block_size),
            priority=ticket.priority,
            arrival=now,
            kv_from_elsewhere=handed_over,
            kv_ready=not handed_over,
        )
        last: list[float | None] = [None]

        def on_tokens(times: list[float], done: bool) -> None:
            previous = last[0]
            if previous is None:
                state.finish_prefill(ticket, times[0], first_token=True)
                # A handed-over request's first token was the prefill engine's.
                outcome.token_times.extend(times[1:] if handed_over else times)
            else:
                outcome.token_times.extend(times)
            earlier = times[-2] if len(times) > 1 else previous
            if earlier is not None:
                # The router's moving average of the step, from the latest gap.
                state.step_s.add(times[-1] - earlier)
            last[0] = times[-1]
            if done:
                state.finish_prefill(ticket, times[-1], first_token=False)
                pooled.state.in_flight -= 1
                on_end(times[-1])

        try:
            engine.scheduler.check(request)
        except ValueError as error:
            pooled.state.in_flight -= 1
            state.finish_prefill(ticket, now, first_token=False)
            outcome.status, outcome.outcome, outcome.error = 400, "error", str(error)
            self._closed(now)
            return
        taken_in = engine.submit(request, on_tokens)
        if handed_over:
            engine.kv_arrives(request.request_id, len(arrival.prompt), taken_in)

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


def describe(config: AppConfig) -> dict[str, Any]:
    """What a client would learn from GET /v1/models and the router's shape."""
    cluster_engine = next(iter(OfflineCluster(config).engines.values()))
    return {
        "model": config.served_name,
        "max_model_len": cluster_engine.stats().max_model_len,
        "shape": config.shape,
    }


def read_arrivals(path: Path) -> list[Arrival]:
    arrivals = []
    with path.open() as lines:
        for line in lines:
            item = json.loads(line)
            arrivals.append(
                Arrival(
                    int(item["index"]),
                    float(item["at"]),
                    [int(token) for token in item["prompt"]],
                    int(item["max_tokens"]),
                    item.get("priority"),
                )
            )
    return arrivals


def serve(config: AppConfig, arrivals: list[Arrival], out: Path, path_ms: float) -> dict[str, Any]:
    """Serve ``arrivals`` offline, write each outcome to ``out`` (JSON lines) and say how
    it went: virtual and wall seconds, each engine's busy share, events."""
    started = time.perf_counter()
    cluster = OfflineCluster(config, path_s=path_ms / 1000)
    outcomes = cluster.run(arrivals)
    elapsed = time.perf_counter() - started
    with out.open("w") as lines:
        for outcome in outcomes:
            lines.write(json.dumps(outcome.to_json()) + "\n")
    virtual = cluster.queue.now
    span = virtual - min((a.at for a in arrivals), default=0.0)
    return {
        "utilization_pct": {
            name: 100.0 * engine.busy_s / span if span > 0 else 0.0
            for name, engine in cluster.engines.items()
        },
        "requests": len(arrivals),
        "engines": len(cluster.engines),
        "virtual_s": virtual,
        "wall_s": elapsed,
        "speedup": virtual / elapsed if elapsed else None,
        "events": cluster.queue.events,
    }


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

    def answer(self, job: dict[str, Any]) -> dict[str, Any]:
        try:
            config = self._application(job["config"], job["profile"], job.get("model"))
            arrivals = self._read(Path(job["requests"]))
            if job.get("at") is not None:
                arrivals = _rescheduled(arrivals, [float(at) for at in job["at"]])
            return serve(config, arrivals, Path(job["out"]), float(job.get("path_ms", 0.0)))
        except (KeyError, ValueError, OSError) as error:
            return {"error": f"{type(error).__name__}: {error}"}

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
    return [dataclasses.replace(a, at=at) for a, at in zip(arrivals, offsets, strict=False)]


def work(lines: Iterable[str], answer: Callable[[str], None]) -> None:
    worker = Worker()
    for line in lines:
        if line.strip():
            answer(json.dumps(worker.answer(json.loads(line))))


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
        print(json.dumps(describe(config)))
        return 0
    if args.requests is None or args.out is None:
        parser.error("run needs --requests and --out")
    print(json.dumps(serve(config, read_arrivals(args.requests), args.out, args.path_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
