"""``python -m loadgen simulate CONFIG --profile P``: a run's results without a server.

The run is prepared exactly as ``python -m loadgen`` prepares one (the same workload,
prompts, arrival schedule and seed); its requests are then served offline, in virtual
time, by ``python -m deployments.simulate`` (the config's router decisions over
simulated engines that keep the profile's time), and each outcome is recorded as the
client would have seen it. The results are a run's: records, vLLM's result schema, the
report and plots. The load generator imports no server package: the simulation runs as
a command, as the sweep runs ``python -m deployments.serve``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from loadgen.client.server_view import ServerView
from loadgen.client.streaming import RequestRecord
from loadgen.config import RunConfig
from loadgen.outputs.stats import (
    RunSummary,
    request_metrics,
    run_duration,
    summarize_run,
)
from loadgen.scheduling.runner import (
    Endpoint,
    PreparedRun,
    Run,
    RunError,
    RunResult,
    arrival_process,
    service_level,
)
from loadgen.study.launcher import REPO_ROOT
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

SIMULATOR = "deployments.simulate"


@dataclass(frozen=True)
class SimulatedTarget:
    """What to simulate: a deployments config (name or YAML) on a latency profile."""

    config: str
    profile: str
    model: str | None = None
    # What the serving path costs a request before the router plans it (HTTP, parsing,
    # tokenization): virtual time has none of it unless given.
    path_ms: float = 0.0

    def command(self, *args: str) -> list[str]:
        model = ["--model", self.model] if self.model else []
        return [
            sys.executable,
            "-m",
            SIMULATOR,
            *args,
            _absolute(self.config),
            "--profile",
            _absolute(self.profile),
            *model,
        ]


def _absolute(name_or_path: str) -> str:
    """A path the caller gave relative to its folder, made absolute: the simulator runs
    in the repository (not in the caller's folder, whose modules could shadow ours)."""
    return str(Path(name_or_path).resolve()) if Path(name_or_path).exists() else name_or_path


class SimulatorWorker:
    """One ``python -m deployments.simulate worker`` process for many runs: its start (the
    router's and Serve's imports, seconds) is paid once, and a requests file it has read
    is served again at other rates from their arrival offsets alone."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def serve(
        self,
        target: SimulatedTarget,
        requests: Path,
        out: Path,
        at: list[float] | None = None,
    ) -> RunSpeed:
        job = Job(
            config=_absolute(target.config),
            profile=_absolute(target.profile),
            model=target.model,
            requests=str(requests),
            out=str(out),
            path_ms=target.path_ms,
            at=at,
        )
        process = self._started()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(encode(job) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise RunError(f"{SIMULATOR} worker exited ({process.wait()})")
        answer = decode(line, Answer)
        if answer.speed is None:
            raise RunError(f"{SIMULATOR} on {target.config}: {answer.error}")
        return answer.speed

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            command = [sys.executable, "-m", SIMULATOR, "worker"]
            self._process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
            )
        return self._process

    def close(self) -> None:
        if self._process is not None and self._process.stdin is not None:
            self._process.stdin.close()  # the worker's loop ends with its input
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> SimulatorWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _simulator(target: SimulatedTarget, *args: str, extra: tuple[str, ...] = ()) -> str:
    command = [*target.command(*args), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RunError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


@functools.cache
def describe(target: SimulatedTarget) -> Description:
    """The served model, its context and the shape, as a client would discover them
    (once per target: a sweep asks for every cell)."""
    return decode(_simulator(target, "describe"), Description)


@dataclass
class _Prepared:
    run: Run  # closed: kept for its notes and its result
    endpoint: Endpoint
    prepared: PreparedRun
    card: Description


async def _prepare_for(config: RunConfig, target: SimulatedTarget, console: Console) -> _Prepared:
    """The run's requests and schedule, prepared as ``python -m loadgen`` prepares them,
    for the model and context the simulated target serves."""
    if config.endpoint != "completions":
        raise ValueError("simulate sends token-id prompts: use --endpoint completions")
    card = describe(target)
    run = Run(config, console, None)
    try:
        endpoint = Endpoint(card.model, config.max_model_len or card.max_model_len)
        prepared = await run.prepare_run(endpoint)
    finally:
        await run.close()
    return _Prepared(run, endpoint, prepared, card)


async def simulate_run(config: RunConfig, target: SimulatedTarget, console: Console) -> RunResult:
    ready = await _prepare_for(config, target, console)
    run, endpoint, prepared, card = ready.run, ready.endpoint, ready.prepared, ready.card
    with tempfile.TemporaryDirectory(prefix="splitserve-simulate-") as folder:
        requests, outcomes = Path(folder) / "requests.jsonl", Path(folder) / "outcomes.jsonl"
        _write_requests(prepared, requests)
        extra: tuple[str, ...] = ("--requests", str(requests), "--out", str(outcomes))
        extra += ("--path-ms", str(target.path_ms))
        speed = decode(_simulator(target, "run", extra=extra), RunSpeed)
        records = [record for record, _ in prepared.items]
        _record_outcomes(records, outcomes)
    note = (
        f"simulated offline on {target.profile}: {speed.virtual_s:.1f} s of serving in"
        f" {speed.wall_s:.2f} s ({speed.speedup or 0:.0f}x real time), {speed.engines}"
        " engines"
    )
    server = ServerView(source="simulation", notes=[note])
    server.set_gpu_utilization(dict(speed.utilization_pct))
    # Virtual time starts at 0; the wall clock of a run that took no time is now.
    run.clock_origin, run.wall_origin = 0.0, time.time()
    run.notes.append(note)
    metrics = [request_metrics(record, 0.0) for record in records]
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    return run.result(config.shape or card.shape, endpoint, prepared, metrics, server, started_at)


def _write_requests(prepared: PreparedRun, path: Path) -> None:
    """What the simulation serves: each request's arrival, prompt and length."""
    write_lines(
        path,
        (
            _arrival(record.index, at, payload)
            for (record, payload), at in zip(prepared.items, prepared.schedule, strict=True)
        ),
    )


def _arrival(index: int, at: float, payload: str | bytes) -> Arrival:
    body = json.loads(payload)  # the completions body a run would send
    return Arrival(index, at, body["prompt"], body["max_tokens"])


def _record_outcomes(records: list[RequestRecord], outcomes: Path) -> None:
    """Each request's record as the client would have filled it; times are virtual."""
    by_index = {record.index: record for record in records}
    for outcome in read_lines(outcomes, Outcome):
        record = by_index[outcome.index]
        arrival = outcome.arrival_s
        record.scheduled_at = record.sent_at = arrival
        record.status = outcome.status
        record.outcome = outcome.outcome
        record.error = outcome.error
        record.prefill = outcome.prefill
        times = outcome.token_times
        record.done_at = times[-1] if times else arrival
        record.chunk_times, record.event_times = list(times), list(times)
        record.chunk_tokens, record.event_counts = [1] * len(times), [1] * len(times)
        record.prompt_tokens = outcome.prompt_tokens
        record.completion_tokens = len(times) if record.outcome == "ok" else None


class OfflineRates:
    """One workload's requests, prepared once (prompts and lengths, as a run prepares
    them), served offline on any config at any rate: between runs only the arrival
    offsets change, so a search over layouts and rates compares like with like.

    With ``seconds``, a run at rate ``q`` serves ``q x seconds`` requests (at least the
    config's ``num_requests``): a fixed count at a high rate arrives in a blink, every
    engine takes its share at once and no queue ever forms, so the run would not show
    what the rate does in steady state. More prompts are prepared when a rate needs
    them. A trace's arrivals are compressed or stretched to the rate asked."""

    def __init__(
        self,
        config: RunConfig,
        worker: SimulatorWorker,
        folder: Path,
        seconds: float | None = None,
    ) -> None:
        self.config = config
        self.worker = worker
        self.folder = folder
        self.seconds = seconds
        self._prepared: PreparedRun | None = None
        self._requests = folder / "requests.jsonl"
        self._target: SimulatedTarget | None = None
        self._console: Console | None = None

    async def prepare(self, target: SimulatedTarget, console: Console) -> None:
        """The prompts, for the model and context ``target`` serves."""
        self._target, self._console = target, console
        await self._prepare(self.config.num_requests)

    async def _prepare(self, count: int) -> None:
        assert self._target is not None and self._console is not None
        config = self.config.model_copy(update={"num_requests": count})
        self._prepared = (await _prepare_for(config, self._target, self._console)).prepared
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_requests(self._prepared, self._requests)

    @property
    def prepared(self) -> PreparedRun:
        if self._prepared is None:
            raise RuntimeError("OfflineRates.prepare first")
        return self._prepared

    def requests_at(self, qps: float) -> int:
        if self.seconds is None or self.prepared.plan.trace_arrivals is not None:
            return len(self.prepared.items)
        return max(self.config.num_requests, math.ceil(qps * self.seconds))

    def schedule(self, qps: float, count: int) -> list[float]:
        prepared = self.prepared
        if prepared.plan.trace_arrivals is None:
            config = self.config.model_copy(update={"qps": qps})
            return arrival_process(config, prepared.plan).schedule(count)
        base = prepared.schedule[:count]
        span = base[-1] - base[0] if count > 1 else 0.0
        if span <= 0:
            return list(base)
        stretch = (count - 1) / span / qps  # the trace's own rate over the one asked
        return [(at - base[0]) * stretch for at in base]

    async def run(self, target: SimulatedTarget, qps: float) -> RunSummary:
        """The run's figures at ``qps`` on ``target`` (the SLOs of the run's config)."""
        count = self.requests_at(qps)
        if count > len(self.prepared.items):
            await self._prepare(max(count, 2 * len(self.prepared.items)))
        outcomes = self.folder / "outcomes.jsonl"
        self.worker.serve(target, self._requests, outcomes, at=self.schedule(qps, count))
        records = [dataclasses.replace(record) for record, _ in self.prepared.items[:count]]
        _record_outcomes(records, outcomes)
        metrics = [request_metrics(record, 0.0) for record in records]
        return summarize_run(metrics, run_duration(metrics), service_level(self.config))
