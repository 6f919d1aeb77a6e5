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

import functools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from loadgen.client import RequestRecord
from loadgen.config import RunConfig
from loadgen.launcher import REPO_ROOT
from loadgen.runner import Endpoint, PreparedRun, Run, RunError, RunResult
from loadgen.server_view import ServerView
from loadgen.stats import request_metrics

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


def _simulator(target: SimulatedTarget, *args: str, extra: tuple[str, ...] = ()) -> str:
    command = [*target.command(*args), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RunError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


@functools.cache
def describe(target: SimulatedTarget) -> dict[str, Any]:
    """The served model, its context and the shape, as a client would discover them
    (once per target: a sweep asks for every cell)."""
    return dict(json.loads(_simulator(target, "describe")))


async def simulate_run(config: RunConfig, target: SimulatedTarget, console: Console) -> RunResult:
    if config.endpoint != "completions":
        raise ValueError("simulate sends token-id prompts: use --endpoint completions")
    card = describe(target)
    run = Run(config, console, None)
    try:
        endpoint = Endpoint(card["model"], config.max_model_len or int(card["max_model_len"]))
        prepared = await run.prepare_run(endpoint)
    finally:
        await run.close()
    with tempfile.TemporaryDirectory(prefix="splitserve-simulate-") as folder:
        requests, outcomes = Path(folder) / "requests.jsonl", Path(folder) / "outcomes.jsonl"
        _write_requests(prepared, requests)
        extra = ("--requests", str(requests), "--out", str(outcomes))
        extra += ("--path-ms", str(target.path_ms))
        speed = json.loads(_simulator(target, "run", extra=extra))
        records = [record for record, _ in prepared.items]
        _record_outcomes(records, outcomes)
    note = (
        f"simulated offline on {target.profile}: {speed['virtual_s']:.1f} s of serving in"
        f" {speed['wall_s']:.2f} s ({speed['speedup']:.0f}x real time), {speed['engines']}"
        " engines"
    )
    server = ServerView(source="simulation", notes=[note])
    server.set_gpu_utilization(dict(speed.get("utilization_pct", {})))
    # Virtual time starts at 0; the wall clock of a run that took no time is now.
    run.clock_origin, run.wall_origin = 0.0, time.time()
    run.notes.append(note)
    metrics = [request_metrics(record, 0.0) for record in records]
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    return run.result(
        config.mode or str(card["mode"]), endpoint, prepared, metrics, server, started_at
    )


def _write_requests(prepared: PreparedRun, path: Path) -> None:
    """What the simulation serves: each request's arrival, prompt and length."""
    with path.open("w") as out:
        for (record, payload), at in zip(prepared.items, prepared.schedule, strict=True):
            body = json.loads(payload)
            line = {
                "index": record.index,
                "at": at,
                "prompt": body["prompt"],
                "max_tokens": body["max_tokens"],
            }
            out.write(json.dumps(line) + "\n")


def _record_outcomes(records: list[RequestRecord], outcomes: Path) -> None:
    """Each request's record as the client would have filled it; times are virtual."""
    by_index = {record.index: record for record in records}
    with outcomes.open() as lines:
        for line in lines:
            outcome = json.loads(line)
            record = by_index[int(outcome["index"])]
            arrival = float(outcome["arrival_s"])
            record.scheduled_at = record.sent_at = arrival
            record.status = int(outcome["status"])
            record.outcome = outcome["outcome"]
            record.error = outcome["error"]
            record.prefill = outcome["prefill"]
            times = [float(t) for t in outcome["token_times"]]
            record.done_at = times[-1] if times else arrival
            record.chunk_times, record.event_times = times, list(times)
            record.chunk_tokens, record.event_counts = [1] * len(times), [1] * len(times)
            record.prompt_tokens = int(outcome["prompt_tokens"])
            record.completion_tokens = len(times) if record.outcome == "ok" else None
