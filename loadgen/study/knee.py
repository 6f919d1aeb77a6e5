"""The knee: the highest request rate at which a given share of requests meets the SLOs.

A bracketing search over rates, each step a real run (``execute_run``): from
``--qps-start`` the rate doubles while the share of requests meeting ``--slo-ttft-ms``
and ``--slo-tpot-ms`` stays at or above ``--attainment``; then the bracket [last good,
first bad] is halved geometrically until its ends are within ``--tolerance`` of each
other or ``--max-steps`` runs are spent. Every step is kept: the curve of goodput and
attainment against rate is the report, the knee its summary.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import Field

from splitserve.config_base import StrictModel


class KneeSearchConfig(StrictModel):
    attainment: float = Field(
        0.9, gt=0, le=1, description="Share of requests that must meet every SLO."
    )
    qps_start: float = Field(1.0, gt=0, description="The first rate tried, requests/s.")
    qps_max: float = Field(256.0, gt=0, description="Never try a rate above this.")
    tolerance: float = Field(
        0.1, gt=0, description="Stop once the bracket's ends are within this ratio."
    )
    max_steps: int = Field(10, ge=2, description="Runs at most.")


@dataclass(frozen=True)
class KneeStep:
    qps: float
    attainment: float
    goodput: float
    request_throughput: float
    ttft_p50_s: float | None
    tpot_p50_s: float | None

    def meets(self, target: float) -> bool:
        return self.attainment >= target


@dataclass
class KneeResult:
    config: dict[str, Any]
    steps: list[KneeStep] = field(default_factory=list)

    @property
    def knee(self) -> KneeStep | None:
        """The highest rate that met the target, if any did."""
        target = self.config["attainment"]
        good = [step for step in self.steps if step.meets(target)]
        return max(good, key=lambda step: step.qps) if good else None

    @property
    def curve(self) -> list[KneeStep]:
        return sorted(self.steps, key=lambda step: step.qps)

    def to_dict(self) -> dict[str, Any]:
        knee = self.knee
        return {
            "config": self.config,
            "knee": asdict(knee) if knee else None,
            "curve": [asdict(step) for step in self.curve],
        }


RunAt = Callable[[float], Awaitable[KneeStep]]


async def find_knee(run_at: RunAt, config: KneeSearchConfig) -> KneeResult:
    """``run_at(qps)``: one real run at that rate, summarized as a step."""
    result = KneeResult(config=config.model_dump())
    target = config.attainment

    async def step(qps: float) -> KneeStep:
        measured = await run_at(qps)
        result.steps.append(measured)
        return measured

    qps = config.qps_start
    good: float | None = None
    bad: float | None = None
    while len(result.steps) < config.max_steps:
        if (await step(qps)).meets(target):
            good = qps
            if qps >= config.qps_max:
                return result  # met the target up to the ceiling: no knee below it
            qps = min(qps * 2, config.qps_max)
        else:
            bad = qps
            break
    if bad is None:
        return result
    if good is None:
        good = 0.0  # not even the first rate: bisect down from it
    while len(result.steps) < config.max_steps and _apart(good, bad, config.tolerance):
        middle = math.sqrt(good * bad) if good > 0 else bad / 2
        if (await step(middle)).meets(target):
            good = middle
        else:
            bad = middle
    return result


def _apart(low: float, high: float, tolerance: float) -> bool:
    return low <= 0 or high / low > 1 + tolerance


def step_of(qps: float, summary: Any) -> KneeStep:
    """A run's figures as one step of the search (``summary``: a RunSummary)."""
    return KneeStep(
        qps=qps,
        attainment=summary.slo_attainment or 0.0,
        goodput=summary.goodput or 0.0,
        request_throughput=summary.request_throughput,
        ttft_p50_s=summary.ttft.p50 if summary.ttft.count else None,
        tpot_p50_s=summary.tpot.p50 if summary.tpot.count else None,
    )
