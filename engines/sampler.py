"""Utilization of one engine replica's devices, sampled every 200 ms, as Ray metrics.

Where the replica holds GPUs and NVML answers, each GPU's utilization and memory in use
are read through NVML (``pynvml`` from ``nvidia-ml-py``), as the study does. Otherwise
(no GPU, no driver, no library: this machine) the CPU use and resident memory of the
replica's own processes are read instead: the replica (vLLM's frontend) and every vLLM
engine process below it (``VLLM::EngineCore``, ``VLLM::Worker_*``). The metric names say
which it is (``splitserve_gpu_*`` or ``splitserve_cpu_*``), and so does the ``source``
label of ``splitserve_utilization_samples_total``. The sampler never fails for lack of
NVML, and a failing read skips one tick instead of stopping the thread.

Gauges hold the latest sample. Ray exports them every ``metrics_report_interval_ms``
(10 s by default), so a gauge seen in Prometheus is one sample out of ~50; the
``*_busy_seconds_total`` counters add every sample (utilization x period), so
``rate()`` over any window is the mean of all 200 ms samples in it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import psutil

from splitserve import metric_catalogue as catalogue

logger = logging.getLogger("splitserve.sampler")

# The study samples NVML every 200 ms; NVML's own utilization window is 1/6 s to 1 s.
SAMPLE_PERIOD_S = 0.2
# Finding the engine processes walks /proc (a few ms); they only change when vLLM
# starts or restarts its workers, so look again every few seconds, not every tick.
PROCESS_REFRESH_S = 5.0
# vLLM names its engine processes with setproctitle: VLLM::EngineCore, VLLM::Worker_TP0.
ENGINE_TITLE_PREFIX = "VLLM::"
REPLICA_PROCESS = "replica"
PERCENT = 100.0


@dataclass(frozen=True)
class DeviceSample:
    """One device (a GPU by index, or an engine process by name) at one tick."""

    device: str
    utilization_percent: float
    memory_used_bytes: float
    busy_seconds: float  # added since the previous tick: utilization x elapsed time


class UtilizationSource(Protocol):
    kind: str  # "gpu" or "cpu": the metric family it feeds
    source: str  # "nvml" or "cpu": what was read

    def read(self) -> list[DeviceSample]: ...

    def close(self) -> None: ...


class NvmlSource:
    """The replica's GPUs through NVML, by physical index."""

    kind = "gpu"
    source = "nvml"

    def __init__(self, nvml: ModuleType, indices: Sequence[int]) -> None:
        self._nvml = nvml
        self._handles = {str(i): nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}
        self._last = time.perf_counter()

    def read(self) -> list[DeviceSample]:
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        samples = []
        for index, handle in self._handles.items():
            utilization = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            memory = float(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
            busy = utilization / PERCENT * elapsed
            samples.append(DeviceSample(index, utilization, memory, busy))
        return samples

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


class EngineCpuSource:
    """CPU use (100 = one core) and resident memory of the replica and its engines."""

    kind = "cpu"
    source = "cpu"

    def __init__(self, root_pid: int, refresh_s: float = PROCESS_REFRESH_S) -> None:
        self._root = psutil.Process(root_pid)
        self._refresh_s = refresh_s
        self._found_at = -float("inf")
        self._processes: dict[str, psutil.Process] = {}
        self._cpu_seconds: dict[int, tuple[float, float]] = {}  # pid -> (cpu s, wall s)

    def read(self) -> list[DeviceSample]:
        now = time.perf_counter()
        if now - self._found_at >= self._refresh_s:
            self._processes = engine_processes(self._root)
            self._found_at = now
        samples = []
        for name, process in self._processes.items():
            with contextlib.suppress(psutil.Error):
                samples.append(self._sample(name, process, now))
        return samples

    def _sample(self, name: str, process: psutil.Process, now: float) -> DeviceSample:
        with process.oneshot():
            times = process.cpu_times()
            rss = float(process.memory_info().rss)
        cpu = times.user + times.system
        previous = self._cpu_seconds.get(process.pid)
        self._cpu_seconds[process.pid] = (cpu, now)
        if previous is None:  # the first look has nothing to compare with
            return DeviceSample(name, 0.0, rss, 0.0)
        busy = max(cpu - previous[0], 0.0)
        utilization = PERCENT * busy / max(now - previous[1], 1e-9)
        return DeviceSample(name, utilization, rss, busy)

    def close(self) -> None:
        pass


def engine_processes(root: psutil.Process) -> dict[str, psutil.Process]:
    """The root (a replica, or an engine core whose host is shared) and the vLLM
    processes below it, by a name stable across ticks."""
    found: dict[str, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        for process in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):
                title = " ".join(process.cmdline())
                if title.startswith(ENGINE_TITLE_PREFIX):
                    name = title.removeprefix(ENGINE_TITLE_PREFIX).split()[0]
                    found[name if name not in found else f"{name}-{process.pid}"] = process
                elif process is root:
                    found[REPLICA_PROCESS] = root
    return found


def open_nvml(gpu_indices: Sequence[int], nvml: ModuleType | None = None) -> NvmlSource | None:
    """An NVML source for these GPUs, or None when there are none or NVML cannot start."""
    if not gpu_indices:
        return None
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        nvml.nvmlInit()
        return NvmlSource(nvml, gpu_indices)
    except Exception as error:  # no library, no driver, no such device: fall back to CPU
        logger.info("NVML unavailable (%s): sampling engine CPU instead", error)
        return None


def choose_source(
    gpu_indices: Sequence[int], root_pid: int, nvml: ModuleType | None = None
) -> UtilizationSource:
    return open_nvml(gpu_indices, nvml) or EngineCpuSource(root_pid)


class MetricsSink(Protocol):
    def record(self, source: UtilizationSource, samples: list[DeviceSample]) -> None: ...


class RayMetricsSink:
    """Ray's metrics (``ray.util.metrics``), exported on every node's metrics port.

    Ray prefixes every name with ``ray_``; dashboards/prometheus.yml strips that prefix
    again for ``splitserve_*`` names, so Prometheus sees the names written here.
    """

    def __init__(self, replica: str, role: str) -> None:
        from ray.util import metrics

        self._tags = {catalogue.REPLICA: replica, catalogue.ROLE: role}
        self._gauges: dict[tuple[str, str], Any] = {}
        self._counters: dict[str, Any] = {}
        for kind in ("gpu", "cpu"):
            for name, families in (
                ("utilization", catalogue.UTILIZATION),
                ("memory", catalogue.MEMORY_USED),
            ):
                family = families[kind]
                self._gauges[kind, name] = metrics.Gauge(
                    family.name, family.help, tag_keys=family.labels
                )
            busy = catalogue.BUSY_SECONDS[kind]
            self._counters[kind] = metrics.Counter(busy.name, busy.help, tag_keys=busy.labels)
        samples = catalogue.UTILIZATION_SAMPLES
        self._samples = metrics.Counter(samples.name, samples.help, tag_keys=samples.labels)
        self._device_label = catalogue.DEVICE_LABEL

    def record(self, source: UtilizationSource, samples: list[DeviceSample]) -> None:
        label = self._device_label[source.kind]
        for sample in samples:
            tags = {**self._tags, label: sample.device}
            self._gauges[source.kind, "utilization"].set(sample.utilization_percent, tags)
            self._gauges[source.kind, "memory"].set(sample.memory_used_bytes, tags)
            if sample.busy_seconds > 0:
                self._counters[source.kind].inc(sample.busy_seconds, tags)
        self._samples.inc(1, {**self._tags, "source": source.source})


class UtilizationSampler:
    """A daemon thread reading one source every ``period_s`` into a sink."""

    def __init__(
        self,
        source: UtilizationSource,
        sink: MetricsSink,
        period_s: float = SAMPLE_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self._sink = sink
        self._period_s = period_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="utilization-sampler", daemon=True)
        self.ticks = 0
        self.busy_s = 0.0  # the sampler's own time spent reading and recording
        self._failing = False

    def start(self) -> UtilizationSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._period_s + 1)
        self.source.close()

    def tick(self) -> None:
        started = time.perf_counter()
        try:
            self._sink.record(self.source, self.source.read())
            self._failing = False
        except Exception:
            # A read can fail transiently (a worker exiting, an NVML hiccup); log the
            # first failure of a run of them and keep sampling.
            if not self._failing:
                logger.warning("utilization sample failed", exc_info=True)
            self._failing = True
        self.ticks += 1
        self.busy_s += time.perf_counter() - started

    def _loop(self) -> None:
        # Fixed-rate schedule: a slow tick does not push every later tick back.
        next_at = self._clock()
        while not self._stop.is_set():
            self.tick()
            next_at += self._period_s
            delay = next_at - self._clock()
            if delay < 0:  # fell behind by more than a period: skip, do not burst
                next_at = self._clock()
                delay = 0.0
            self._stop.wait(delay)


def start_replica_sampler(
    replica: str, role: str, gpu_indices: Sequence[int], root_pid: int
) -> UtilizationSampler | None:
    """Start sampling one engine's GPUs, or the CPU of ``root_pid`` and the engine
    processes below it; None if metrics are unavailable."""
    try:
        source = choose_source(gpu_indices, root_pid)
        sampler = UtilizationSampler(source, RayMetricsSink(replica, role)).start()
    except Exception:  # metrics must never stop an engine from serving
        logger.warning("utilization sampler not started for %s", replica, exc_info=True)
        return None
    logger.info(
        "utilization sampler for %s: %s every %.0f ms",
        replica,
        source.source,
        1000 * SAMPLE_PERIOD_S,
    )
    return sampler
