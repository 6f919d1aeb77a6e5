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

# The names engine replicas report their measurements under (record_autoscaling_stats):
# what their requests got, and what a request they serve alone gets (the floor).
TTFT_METRIC = "ttft_s"
TPOT_METRIC = "tpot_s"
TTFT_FLOOR_METRIC = "ttft_floor_s"
TPOT_FLOOR_METRIC = "tpot_floor_s"


def slo_pressure(ttft_s: float, tpot_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """How much of its SLOs one engine uses: the worse of TTFT and TPOT, as a share."""
    return max(ttft_s / ttft_slo_s, tpot_s / tpot_slo_s)


def with_one_fewer(value: float, floor: float, engines: int) -> float:
    """What ``value`` would be with the same load on one engine fewer: its floor (what
    one request alone gets) stays, and the part the load adds grows by n/(n-1)."""
    floor = min(floor, value)
    return floor + (value - floor) * engines / (engines - 1)


def pool_pressure(
    metrics: Mapping[str, Mapping[Any, float]],
    ttft_slo_s: float,
    tpot_slo_s: float,
    one_fewer_of: int | None = None,
) -> float:
    """The engines' mean share of the SLOs (0 before any engine reported); with
    ``one_fewer_of=n``, the share expected with the same load on n - 1 of the n engines.

    The mean, not the worst: routers spread the load over every engine, so one engine
    above the line while the others idle is a routing matter, not a size matter."""
    ttft = metrics.get(TTFT_METRIC, {})
    tpot = metrics.get(TPOT_METRIC, {})
    replicas = set(ttft) | set(tpot)
    if not replicas:
        return 0.0
    shares = []
    for replica in replicas:
        replica_ttft, replica_tpot = ttft.get(replica, 0.0), tpot.get(replica, 0.0)
        if one_fewer_of is not None and one_fewer_of > 1:
            floors = (metrics.get(TTFT_FLOOR_METRIC, {}), metrics.get(TPOT_FLOOR_METRIC, {}))
            replica_ttft = with_one_fewer(replica_ttft, floors[0].get(replica, 0.0), one_fewer_of)
            replica_tpot = with_one_fewer(replica_tpot, floors[1].get(replica, 0.0), one_fewer_of)
        shares.append(slo_pressure(replica_ttft, replica_tpot, ttft_slo_s, tpot_slo_s))
    return sum(shares) / len(shares)


def desired_replicas(
    running: int,
    target: int,
    pressure: float,
    pressure_one_fewer: float,
    scale_up_at: float,
    scale_down_at: float,
) -> int:
    """The engine count to aim for, one engine more or fewer than ``target`` (the count
    Serve is already moving to) at a time: an engine takes tens of seconds to start, and
    a step the measurement has not seen the effect of yet would overshoot.

    Grow when the pool is at ``scale_up_at`` of its SLOs. Shrink when one engine fewer
    would be expected at most ``scale_down_at`` (below ``scale_up_at``: the band between
    is the hysteresis that keeps a shrink from growing straight back). While an engine
    is still starting (``running < target``) the count holds unless shrinking is due:
    the load has not reached the new engine yet, so the pressure says nothing about
    whether it is needed."""
    target = max(target, 1)
    shrink = target > 1 and pressure_one_fewer <= scale_down_at
    if running < target and not shrink:
        return target
    if pressure >= scale_up_at:
        return target + 1
    return target - 1 if shrink else target


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
        metrics = ctx.aggregated_metrics or {}
        target = ctx.target_num_replicas
        pressure = pool_pressure(metrics, self.ttft_slo_s, self.tpot_slo_s)
        one_fewer = pool_pressure(metrics, self.ttft_slo_s, self.tpot_slo_s, one_fewer_of=target)
        wanted = desired_replicas(
            ctx.current_num_replicas,
            target,
            pressure,
            one_fewer,
            self.scale_up_at,
            self.scale_down_at,
        )
        return wanted, {"slo_pressure": pressure, "slo_pressure_one_fewer": one_fewer}
