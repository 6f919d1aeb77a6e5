"""How many engines a scaled pool wants, from what its engines measure of the SLOs.

Ray Serve runs ``SloPolicy`` in its controller as the pool deployment's autoscaling
policy (``autoscaling_config.policy``), and applies ``min_replicas``/``max_replicas``
and the up- and downscale delays to what it returns. Each engine replica reports its
own measured time to first token and time per output token (engines/slo_meter.py,
through ``record_autoscaling_stats``); this module turns them into one decision.

Serve pickles this module by value into its controller, which cannot import ours:
it uses the standard library only, and its settings arrive as ``policy_kwargs``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The names engine replicas report their measurements under (record_autoscaling_stats).
TTFT_METRIC = "ttft_s"
TPOT_METRIC = "tpot_s"


def slo_pressure(ttft_s: float, tpot_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """How much of its SLOs one engine uses: the worse of TTFT and TPOT, as a share."""
    return max(ttft_s / ttft_slo_s, tpot_s / tpot_slo_s)


def pool_pressure(
    metrics: Mapping[str, Mapping[Any, float]], ttft_slo_s: float, tpot_slo_s: float
) -> float:
    """The engines' mean share of the SLOs (0 before any engine reported).

    The mean, not the worst: routers spread the load over every engine, so one engine
    above the line while the others idle is a routing matter, not a size matter."""
    ttft = metrics.get(TTFT_METRIC, {})
    tpot = metrics.get(TPOT_METRIC, {})
    replicas = set(ttft) | set(tpot)
    if not replicas:
        return 0.0
    shares = [
        slo_pressure(ttft.get(r, 0.0), tpot.get(r, 0.0), ttft_slo_s, tpot_slo_s) for r in replicas
    ]
    return sum(shares) / len(shares)


def desired_replicas(
    current: int, pressure: float, scale_up_at: float, scale_down_at: float
) -> int:
    """One engine more or fewer at a time: an engine takes tens of seconds to start, and
    a step the measurement has not seen the effect of yet would overshoot.

    Shrinking needs two things: the pool is at most ``scale_down_at`` of its SLOs, and
    the same load over one engine fewer would still stay under ``scale_up_at``. Without
    the second, two engines at 0.5 would shrink to one at 1.0 and grow straight back."""
    if current < 1:
        return 1
    if pressure >= scale_up_at:
        return current + 1
    shrinkable = current > 1 and pressure <= scale_down_at
    if shrinkable and pressure * current / (current - 1) < scale_up_at:
        return current - 1
    return current


class SloPolicy:
    """Serve's custom autoscaling policy for a scaled pool: Serve builds it once with the
    pool's ``policy_kwargs`` and calls it with an ``AutoscalingContext`` every tick."""

    def __init__(
        self, ttft_slo_s: float, tpot_slo_s: float, scale_up_at: float, scale_down_at: float
    ) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.scale_up_at = scale_up_at
        self.scale_down_at = scale_down_at

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        pressure = pool_pressure(ctx.aggregated_metrics or {}, self.ttft_slo_s, self.tpot_slo_s)
        wanted = desired_replicas(
            ctx.current_num_replicas, pressure, self.scale_up_at, self.scale_down_at
        )
        return wanted, {"slo_pressure": pressure}
