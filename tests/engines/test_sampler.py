"""The utilization sampler: CPU of engine processes without NVML (as here), GPUs through
pynvml's interface (a fake library: this machine has no GPU), and a 200 ms cadence.

No check here depends on how fast this machine is: figures are bracketed by clock and
CPU-time readings taken around each read, the schedule runs on a clock of the test's
own, and the real thread is only held to "never early" (bench figures: docs/DECISIONS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import psutil
import pynvml
import pytest

from engines import sampler as sampler_module
from engines.metrics import replica_stat_logger
from engines.sampler import (
    PROCESS_REFRESH_S,
    REPLICA_PROCESS,
    SAMPLE_PERIOD_S,
    DeviceSample,
    EngineCpuSource,
    NvmlSource,
    UtilizationSampler,
    UtilizationSource,
    choose_source,
    engine_processes,
)

# A child that names itself like a vLLM process, then spins or sleeps.
CHILD = """
import sys, time, setproctitle
setproctitle.setproctitle(sys.argv[1])
print("ready", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    if sys.argv[2] == "sleep":
        time.sleep(0.5)
"""
# CPU seconds the spinning child must have used between two reads, and how long to wait
# for them at most (a guard against a child that never runs, not a speed requirement).
SPIN_S = 0.3
WAIT_S = 20.0  # the children spin or sleep for 30 s
# Rounding room for figures recomputed from the sampler's floats.
EPSILON_S = 1e-9


# The engine replica the children are found under: a process of their own, since the
# test process may have engine descendants of the suite's (an application started
# early, bare vLLM). It prints its children's PIDs, spinner first, and keeps them until
# its standard input closes.
REPLICA = """
import subprocess, sys
child = sys.argv[1]
titles = (
    ("VLLM::Worker_TP0", "spin"), ("VLLM::EngineCore", "sleep"), ("python not-an-engine", "sleep")
)
children = [
    subprocess.Popen([sys.executable, "-c", child, t, b], stdout=subprocess.PIPE, text=True)
    for t, b in titles
]
assert all(c.stdout.readline().strip() == "ready" for c in children)
print(" ".join(str(c.pid) for c in children), flush=True)
sys.stdin.read()
for c in children:
    c.kill()
    c.wait()
"""


@dataclass(frozen=True)
class EngineChildren:
    replica: int  # the PID the sampler walks from
    spinner: int  # VLLM::Worker_TP0, which spins


@pytest.fixture
def engine_children() -> Iterator[EngineChildren]:
    replica = subprocess.Popen(
        [sys.executable, "-c", REPLICA, CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert replica.stdout is not None and replica.stdin is not None
    spinner, _sleeper, _other = (int(pid) for pid in replica.stdout.readline().split())
    yield EngineChildren(replica.pid, spinner)
    replica.stdin.close()
    assert replica.wait(10) == 0


def _by_device(samples: list[DeviceSample]) -> dict[str, DeviceSample]:
    return {sample.device: sample for sample in samples}


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def test_without_nvml_reports_cpu_of_engine_processes(engine_children: EngineChildren) -> None:
    # This machine has no NVIDIA library: even asked for GPU 0, the real pynvml fails to
    # start and the sampler falls back to the CPU of the engine processes.
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
    source = choose_source([0], engine_children.replica)
    assert isinstance(source, EngineCpuSource)
    assert (source.kind, source.source) == ("cpu", "cpu")
    spinner = psutil.Process(engine_children.spinner)
    # Every figure is bracketed by readings taken just before and just after each read,
    # so the checks hold however slowly this machine runs the children or the reads.
    cpu_before_first, before_first = _cpu_s(spinner), time.perf_counter()
    first = _by_device(source.read())
    after_first, cpu_after_first = time.perf_counter(), _cpu_s(spinner)
    assert set(first) == {REPLICA_PROCESS, "Worker_TP0", "EngineCore"}  # not the other child
    assert all(s.utilization_percent == 0.0 for s in first.values())  # nothing to compare yet
    # Wait until the spinner has been given SPIN_S of CPU, however long that takes here.
    deadline = time.monotonic() + WAIT_S
    while _cpu_s(spinner) - cpu_after_first < SPIN_S:
        assert time.monotonic() < deadline, "the spinning child got no CPU"
        time.sleep(0.05)
    cpu_before_second, before_second = _cpu_s(spinner), time.perf_counter()
    second = _by_device(source.read())
    after_second, cpu_after_second = time.perf_counter(), _cpu_s(spinner)
    worker, core = second["Worker_TP0"], second["EngineCore"]
    # busy seconds are the spinner's CPU seconds between the two reads ...
    assert cpu_before_second - cpu_after_first - EPSILON_S <= worker.busy_seconds
    assert worker.busy_seconds <= cpu_after_second - cpu_before_first + EPSILON_S
    # ... and utilization is busy seconds over the wall time between the two reads.
    wall_s = worker.busy_seconds / (worker.utilization_percent / 100)
    assert (
        before_second - after_first - EPSILON_S <= wall_s <= after_second - before_first + EPSILON_S
    )
    # The sleeping engine process used next to nothing of what the spinner used.
    assert core.busy_seconds < worker.busy_seconds / 10
    assert core.utilization_percent < worker.utilization_percent / 10
    assert worker.memory_used_bytes == pytest.approx(spinner.memory_info().rss, rel=0.2)


def test_no_gpu_assigned_means_cpu_even_with_nvml() -> None:
    fake = FakeNvml(gpus={0: (50, 1 << 30)})
    assert isinstance(choose_source([], os.getpid(), nvml=fake), EngineCpuSource)
    assert not fake.initialised


class FakeNvml(ModuleType):
    """The part of pynvml's interface the sampler uses, answering for made-up GPUs."""

    API = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
    )

    def __init__(self, gpus: dict[int, tuple[int, int]]) -> None:
        super().__init__("fake_pynvml")
        self.gpus = gpus  # index -> (utilization %, memory used bytes)
        self.initialised = False

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index not in self.gpus:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=self.gpus[handle][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=self.gpus[handle][1], total=80 << 30, free=0)


def test_fake_nvml_matches_pynvml_interface() -> None:
    for name in FakeNvml.API:
        assert callable(getattr(pynvml, name)), name


def test_nvml_path_with_fake_library_no_gpu_here() -> None:
    fake = FakeNvml(gpus={0: (90, 3 << 30), 1: (10, 1 << 30), 2: (55, 2 << 30)})
    opened_at = time.perf_counter()
    source = choose_source([0, 2], os.getpid(), nvml=fake)  # the replica holds GPUs 0 and 2
    opened = time.perf_counter()
    assert isinstance(source, NvmlSource)
    assert (source.kind, source.source) == ("gpu", "nvml")
    time.sleep(SAMPLE_PERIOD_S)
    before_read = time.perf_counter()
    samples = _by_device(source.read())
    after_read = time.perf_counter()
    assert set(samples) == {"0", "2"}
    assert samples["0"].utilization_percent == 90 and samples["2"].utilization_percent == 55
    assert samples["0"].memory_used_bytes == 3 << 30
    # busy = utilization x the time since the previous read (here: since the source
    # opened), bracketed by clock readings around the opening and around the read.
    elapsed_s = samples["0"].busy_seconds / 0.9
    assert before_read - opened - EPSILON_S <= elapsed_s <= after_read - opened_at + EPSILON_S
    source.close()
    assert not fake.initialised


def test_nvml_failing_for_a_gpu_falls_back_to_cpu() -> None:
    fake = FakeNvml(gpus={0: (10, 1)})
    assert isinstance(choose_source([3], os.getpid(), nvml=fake), EngineCpuSource)


class RecordingSink:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.ticks: list[float] = []
        self._clock = clock

    def record(self, source: UtilizationSource, samples: list[DeviceSample]) -> None:
        self.ticks.append(self._clock())


class FlakySource:
    kind = source = "cpu"

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> list[DeviceSample]:
        self.reads += 1
        if self.reads % 2:
            raise OSError("process went away")
        return []

    def close(self) -> None:
        pass


class SteppedClock:
    """Time that moves only when something says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostlySource(FlakySource):
    """Every other read fails; read n takes ``costs[n]`` seconds of the stepped clock."""

    def __init__(self, clock: SteppedClock, costs: list[float]) -> None:
        super().__init__()
        self._clock = clock
        self._costs = costs
        self.started: list[float] = []

    def read(self) -> list[DeviceSample]:
        self.started.append(self._clock.now)
        self._clock.now += self._costs[len(self.started) - 1]
        return super().read()


class SteppedStop:
    """The sampler's stop event on the stepped clock: a wait moves the clock instead of
    sleeping; the loop stops after ``waits`` waits."""

    def __init__(self, clock: SteppedClock, waits: int) -> None:
        self._clock = clock
        self._waits = waits
        self.delays: list[float] = []

    def is_set(self) -> bool:
        return len(self.delays) >= self._waits

    def set(self) -> None:
        self._waits = 0

    def wait(self, timeout: float) -> bool:
        self.delays.append(timeout)
        self._clock.now += timeout
        return self.is_set()


def test_the_study_samples_every_200_ms() -> None:
    assert SAMPLE_PERIOD_S == 0.2


def test_ticks_keep_a_fixed_rate_and_skip_rather_than_burst_when_behind() -> None:
    # The schedule on a clock of the test's own: each read's cost is set, so are the
    # times of every tick, whatever the speed of this machine.
    clock = SteppedClock()
    period = SAMPLE_PERIOD_S
    costs = [0.01, 0.05, 0.01, 2.5 * period, 0.01, 0.03, 0.01, 0.01]  # the 4th overruns
    source = CostlySource(clock, costs)
    sink = RecordingSink(clock)
    sampler = UtilizationSampler(source, sink, clock=clock)
    sampler._stop = SteppedStop(clock, waits=len(costs))  # type: ignore[assignment]
    sampler._loop()
    late = 3 * period + costs[3]  # the tick after the slow one: at once, then every period
    expected = [0.0, period, 2 * period, 3 * period, late, late + period, late + 2 * period]
    assert source.started == pytest.approx([*expected, late + 3 * period])
    # A slow read does not push the next tick back (fixed rate, not fixed delay) ...
    assert source.started[2] - source.started[1] == pytest.approx(period)
    # ... and one that overran its period is followed by one tick, not a burst.
    assert source.started[5] - source.started[4] == pytest.approx(period)
    # Failing reads (every other one) cost a sample each, never the loop.
    assert (sampler.ticks, source.reads, len(sink.ticks)) == (8, 8, 4)


def test_the_sampler_thread_ticks_on_schedule_until_stopped() -> None:
    sink, source = RecordingSink(), FlakySource()
    others = set(threading.enumerate())
    started = time.monotonic()
    sampler = UtilizationSampler(source, sink).start()
    (thread,) = (t for t in threading.enumerate() if t not in others)
    assert thread.name == "utilization-sampler" and thread.daemon
    deadline = started + WAIT_S
    while source.reads < 6:
        assert time.monotonic() < deadline, f"{source.reads} reads in {WAIT_S} s"
        time.sleep(0.05)
    reads, seen = source.reads, time.monotonic()
    sampler.stop()
    # Never ahead of the schedule: read n comes (n - 1) periods after the first at the
    # earliest. (A slow machine makes reads later, never sooner.)
    assert (reads - 1) * SAMPLE_PERIOD_S <= seen - started + 1e-3, (reads, seen - started)
    while thread.is_alive():
        assert time.monotonic() < deadline, "the sampler thread outlived stop()"
        time.sleep(0.05)
    assert len(sink.ticks) == source.reads // 2  # failing reads skipped, not fatal


def test_sampler_overhead_is_small_with_real_cpu_source(
    engine_children: EngineChildren, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks: list[float] = []

    def counted_walk(root: psutil.Process) -> dict[str, psutil.Process]:
        walks.append(time.perf_counter())
        return engine_processes(root)

    monkeypatch.setattr(sampler_module, "engine_processes", counted_walk)
    sampler = UtilizationSampler(EngineCpuSource(engine_children.replica), RecordingSink())
    started = time.perf_counter()
    for _ in range(20):
        sampler.tick()
    elapsed_s = time.perf_counter() - started
    per_tick_s = sampler.busy_s / sampler.ticks
    print(f"sampler: {1000 * per_tick_s:.2f} ms per tick (3 children, first tick walks /proc)")
    # What keeps a tick cheap: /proc is walked once per PROCESS_REFRESH_S, not per tick.
    assert 1 <= len(walks) <= 1 + elapsed_s / PROCESS_REFRESH_S, (len(walks), elapsed_s)
    # The figure itself is docs/DECISIONS.md's (0.6 ms); here only a bound that a tick
    # which blocks (a psutil call with an interval, say) breaks, not a slow machine.
    assert per_tick_s < SAMPLE_PERIOD_S / 2


def test_engine_stat_logger_adds_replica_and_role() -> None:
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    logger_class = replica_stat_logger("prefill-0", "prefill")
    assert issubclass(logger_class, RayPrometheusStatLogger)
    gauge = logger_class._gauge_cls("vllm:test_gauge", "doc", labelnames=["model_name", "engine"])
    assert gauge.metric._tag_keys == ("model_name", "engine", "ReplicaId", "replica", "role")
    tags = gauge.labels("tiny", "0")._tags
    assert tags == {
        "model_name": "tiny",
        "engine": "0",
        "ReplicaId": "",
        "replica": "prefill-0",
        "role": "prefill",
    }
    with pytest.raises(ValueError):
        gauge.labels("tiny")
    counter = logger_class._counter_cls("vllm:test_counter", "doc", labelnames=["model_name"])
    assert counter.labels(model_name="x")._tags["role"] == "prefill"
