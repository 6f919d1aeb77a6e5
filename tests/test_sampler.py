"""The utilization sampler: CPU of engine processes without NVML (as here), GPUs through
pynvml's interface (a fake library: this machine has no GPU), and a 200 ms cadence."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import psutil
import pynvml
import pytest

from engines.metrics import replica_stat_logger
from engines.sampler import (
    REPLICA_PROCESS,
    SAMPLE_PERIOD_S,
    DeviceSample,
    EngineCpuSource,
    NvmlSource,
    UtilizationSampler,
    UtilizationSource,
    choose_source,
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
# A spinning process gets most of a core even on two shared ones; a sleeping one ~0.
SPINNING_MIN_PERCENT = 30.0
SLEEPING_MAX_PERCENT = 5.0
MEASURE_S = 1.0


def _child(title: str, behaviour: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, title, behaviour], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


@pytest.fixture
def engine_children() -> Iterator[list[subprocess.Popen[str]]]:
    children = [
        _child("VLLM::Worker_TP0", "spin"),
        _child("VLLM::EngineCore", "sleep"),
        _child("python not-an-engine", "sleep"),
    ]
    yield children
    for child in children:
        child.kill()
        child.wait()


def _by_device(samples: list[DeviceSample]) -> dict[str, DeviceSample]:
    return {sample.device: sample for sample in samples}


def test_without_nvml_reports_cpu_of_engine_processes(engine_children: list) -> None:
    # This machine has no NVIDIA library: even asked for GPU 0, the real pynvml fails to
    # start and the sampler falls back to the CPU of the engine processes.
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
    source = choose_source([0], os.getpid())
    assert isinstance(source, EngineCpuSource)
    assert (source.kind, source.source) == ("cpu", "cpu")
    first = _by_device(source.read())
    assert set(first) == {REPLICA_PROCESS, "Worker_TP0", "EngineCore"}  # not the other child
    assert all(s.utilization_percent == 0.0 for s in first.values())  # nothing to compare yet
    time.sleep(MEASURE_S)
    second = _by_device(source.read())
    assert second["Worker_TP0"].utilization_percent > SPINNING_MIN_PERCENT
    assert second["EngineCore"].utilization_percent < SLEEPING_MAX_PERCENT
    spinner = psutil.Process(engine_children[0].pid)
    assert second["Worker_TP0"].memory_used_bytes == pytest.approx(
        spinner.memory_info().rss, rel=0.2
    )
    # busy seconds are CPU seconds: about utilization x elapsed
    assert second["Worker_TP0"].busy_seconds == pytest.approx(
        second["Worker_TP0"].utilization_percent / 100 * MEASURE_S, rel=0.3
    )


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
    source = choose_source([0, 2], os.getpid(), nvml=fake)  # the replica holds GPUs 0 and 2
    assert isinstance(source, NvmlSource)
    assert (source.kind, source.source) == ("gpu", "nvml")
    time.sleep(SAMPLE_PERIOD_S)
    samples = _by_device(source.read())
    assert set(samples) == {"0", "2"}
    assert samples["0"].utilization_percent == 90 and samples["2"].utilization_percent == 55
    assert samples["0"].memory_used_bytes == 3 << 30
    # busy = utilization x the time since the previous read (about one period)
    assert samples["0"].busy_seconds == pytest.approx(0.9 * SAMPLE_PERIOD_S, rel=0.5)
    source.close()
    assert not fake.initialised


def test_nvml_failing_for_a_gpu_falls_back_to_cpu() -> None:
    fake = FakeNvml(gpus={0: (10, 1)})
    assert isinstance(choose_source([3], os.getpid(), nvml=fake), EngineCpuSource)


class RecordingSink:
    def __init__(self) -> None:
        self.ticks: list[float] = []

    def record(self, source: UtilizationSource, samples: list[DeviceSample]) -> None:
        self.ticks.append(time.monotonic())


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


def test_samples_every_200_ms_and_survives_failing_reads() -> None:
    sink, source = RecordingSink(), FlakySource()
    sampler = UtilizationSampler(source, sink).start()
    time.sleep(10 * SAMPLE_PERIOD_S + SAMPLE_PERIOD_S / 2)
    sampler.stop()
    assert 10 <= source.reads <= 12  # ~11 ticks in 2.1 s; a failing read is not fatal
    gaps = [b - a for a, b in zip(sink.ticks, sink.ticks[1:], strict=False)]
    assert gaps and all(gap == pytest.approx(2 * SAMPLE_PERIOD_S, abs=0.05) for gap in gaps)


def test_sampler_overhead_is_small_with_real_cpu_source(engine_children: list) -> None:
    sampler = UtilizationSampler(EngineCpuSource(os.getpid()), RecordingSink())
    for _ in range(20):
        sampler.tick()
    per_tick_s = sampler.busy_s / sampler.ticks
    print(f"sampler: {1000 * per_tick_s:.2f} ms per tick (3 children, first tick walks /proc)")
    # Under 5% of one core at one tick per 200 ms.
    assert per_tick_s < 0.05 * SAMPLE_PERIOD_S


def test_engine_stat_logger_adds_replica_and_role() -> None:
    logger_class = replica_stat_logger("prefill-0", "prefill")
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
