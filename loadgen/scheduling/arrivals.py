"""When each request is sent: offsets in seconds from the start of a run.

Every process returns the whole schedule up front, so a run with the same seed sends
at the same offsets, and the sender only has to sleep until the next one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from loadgen.config import ARRIVALS


class ArrivalProcess(Protocol):
    """Something that can lay out ``n`` send times (seconds, non-decreasing, first at 0)."""

    def schedule(self, n: int) -> list[float]: ...

    @property
    def label(self) -> str: ...


class RateArrivals(Protocol):
    """A registered arrival process (``--arrival-process NAME``): built from the rate,
    the seed and ``--burstiness``, whichever of them it uses."""

    @classmethod
    def at_rate(cls, rate: float, seed: int, burstiness: float) -> ArrivalProcess: ...


@ARRIVALS.register("poisson")
@dataclass(frozen=True)
class PoissonArrivals:
    """Independent exponential gaps with mean ``1 / rate``: the study's QPS 1, 2, 4, 8."""

    rate: float
    seed: int = 0

    @classmethod
    def at_rate(cls, rate: float, seed: int, burstiness: float) -> PoissonArrivals:
        return cls(rate, seed)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"a Poisson rate must be positive and finite, not {self.rate}")

    def schedule(self, n: int) -> list[float]:
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0 / self.rate, size=max(n - 1, 0))
        return [0.0, *np.cumsum(gaps).tolist()][:n]

    @property
    def label(self) -> str:
        return f"{self.rate:g}"


@ARRIVALS.register("constant")
@dataclass(frozen=True)
class ConstantArrivals:
    """Evenly spaced sends; useful to measure the client's own send lag."""

    rate: float

    @classmethod
    def at_rate(cls, rate: float, seed: int, burstiness: float) -> ConstantArrivals:
        return cls(rate)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"a constant rate must be positive and finite, not {self.rate}")

    def schedule(self, n: int) -> list[float]:
        return [index / self.rate for index in range(n)]

    @property
    def label(self) -> str:
        return f"{self.rate:g}"


@ARRIVALS.register("gamma")
@dataclass(frozen=True)
class GammaArrivals:
    """Gamma-distributed gaps: ``shape`` < 1 is burstier than Poisson (BurstGPT's fit)."""

    rate: float
    shape: float
    seed: int = 0

    @classmethod
    def at_rate(cls, rate: float, seed: int, burstiness: float) -> GammaArrivals:
        return cls(rate, burstiness, seed)

    def schedule(self, n: int) -> list[float]:
        rng = np.random.default_rng(self.seed)
        gaps = rng.gamma(self.shape, 1.0 / (self.rate * self.shape), size=max(n - 1, 0))
        return [0.0, *np.cumsum(gaps).tolist()][:n]

    @property
    def label(self) -> str:
        return f"gamma{self.rate:g}"


def ramp_up_rates(
    strategy: Literal["linear", "exponential"], start_rps: float, end_rps: float, n: int
) -> list[float]:
    """Request i's rate, as vLLM's ``_get_current_request_rate``: from ``start_rps`` for
    the first request to ``end_rps`` for the last, linearly or geometrically."""
    rates = []
    for index in range(n):
        progress = index / max(n - 1, 1)
        if strategy == "linear":
            rates.append(start_rps + (end_rps - start_rps) * progress)
        else:
            rates.append(start_rps * (end_rps / start_rps) ** progress)
    return rates


@dataclass(frozen=True)
class RampUpArrivals:
    """vLLM's ``--ramp-up-strategy``: the gap before request i is drawn at request i's
    rate (``ramp_up_rates``), as vLLM draws it: gamma with shape ``burstiness`` (Poisson
    at 1), constant at inf. Unlike vLLM, the first request is sent at once."""

    strategy: Literal["linear", "exponential"]
    start_rps: float
    end_rps: float
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.start_rps <= self.end_rps:
            raise ValueError(
                f"a ramp-up needs 0 < start <= end, not {self.start_rps}..{self.end_rps}"
            )

    def schedule(self, n: int) -> list[float]:
        rng = np.random.default_rng(self.seed)
        rates = np.asarray(ramp_up_rates(self.strategy, self.start_rps, self.end_rps, n))
        if math.isinf(self.burstiness):
            gaps = 1.0 / rates
        else:
            gaps = rng.gamma(self.burstiness, 1.0 / (rates * self.burstiness))
        return (np.cumsum(gaps) - gaps[0]).tolist() if n else []

    @property
    def label(self) -> str:
        return f"ramp-{self.strategy}-{self.start_rps:g}-{self.end_rps:g}"


@dataclass(frozen=True)
class UnlimitedArrivals:
    """QPS ``inf``: everything is due at once; ``--max-concurrency`` is the only brake."""

    def schedule(self, n: int) -> list[float]:
        return [0.0] * n

    @property
    def label(self) -> str:
        return "inf"


@dataclass(frozen=True)
class TraceReplayArrivals:
    """A trace's own inter-arrival times, multiplied by ``time_scale`` (0.5: twice as fast)."""

    timestamps: Sequence[float]
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale must be positive, not {self.time_scale}")

    def schedule(self, n: int) -> list[float]:
        if n > len(self.timestamps):
            raise ValueError(f"the trace window has {len(self.timestamps)} arrivals, not {n}")
        start = self.timestamps[0] if n else 0.0
        return [(t - start) * self.time_scale for t in self.timestamps[:n]]

    @property
    def label(self) -> str:
        return "replay"


def make_arrivals(qps: float, process: str, seed: int, burstiness: float = 1.0) -> ArrivalProcess:
    """The study's rates: a finite QPS follows the registered process (Poisson by
    default; gamma with shape ``burstiness``), inf is unlimited."""
    if math.isinf(qps):
        return UnlimitedArrivals()
    factory = ARRIVALS.get(process)
    return factory.at_rate(qps, seed, burstiness)


def format_qps(qps: float) -> str:
    """The label a rate has in tables, files and metrics: '1', '0.5', 'inf'."""
    return "inf" if math.isinf(qps) else f"{qps:g}"
