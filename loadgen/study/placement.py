"""Which shape, for a device type and a budget: DistServe's placement search, on
simulated engines (``python -m loadgen advise --simulate PROFILE --devices N``).

Every way to lay the model out on ``N`` devices is a candidate:

- one engine over all of them (``single``, ``tp``, ``pp``: a degree whose ranks are N);
- replicas of one degree (``dp``, and ``auto``'s engines, at least two);
- a prefill pool and a decode pool that together take the N devices, in every P:D
  ratio (``pd``, and ``pd_always``: every prompt prefilled remotely), DistServe's ratio
  search. DistServe also gives each phase its own degree; here both pools share one,
  because the KV hand-over copies blocks rank to rank and the config refuses pools whose
  KV layouts differ.

The degrees are those the latency profile has (a shipped family's members, such as
``h100-llama-3.1-8b-tp2-pp1``, or a profile file's one). Each candidate's goodput is the
knee of its SLO attainment against the request rate (``loadgen/study/knee.py``: doubling, then
halving the bracket), every step one offline run of the same prompts at that rate
(``python -m deployments.simulate``, in one worker process). The first candidate's
search starts at ``--qps-start``, the others at the best knee found so far: on one
budget the knees are of one scale. The highest knee wins; within ``TIE_SHARE`` of it, or within the
profile's error on public runs it was not fitted on (its ``ErrorBand``) where that is
wider, the fewer moving parts win (the advisor's simplicity order, then fewer engines):
a simulation cannot tell apart two knees closer than its own error.

Not searched: placement across nodes (every candidate is one node's devices; DistServe
searches that too), and each template's router and prefill-policy settings, which are
kept as the template sets them except for the objectives (QoS's TTFT objective is the
one given, and PD's remote-prefill budget half of it).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen.scheduling.runner import RunError
from loadgen.study.advisor import PD_SHAPES, SIMPLICITY, TIE_SHARE, Objectives, simplest_near_best
from loadgen.study.deployment_plan import CPU_ONLY_POOL_KEYS, GPU_MODEL_DTYPE
from loadgen.study.knee import KneeResult, KneeSearchConfig, KneeStep, find_knee
from splitserve.latency.profile import load_profile, shipped_profiles

SEARCH_SHAPES = ("single", "tp", "pp", "dp", "auto", "pd", "pd_always")
# The template of each shape (a YAML under deployments/) and the shape it serves.
ONE_ENGINE_SHAPES = ("single", "tp", "pp")
REPLICA_SHAPES = ("dp", "auto")
# The fewest engines of a replica shape: dp of one engine is single; auto needs a peer.
MIN_REPLICAS = 2


@dataclass(frozen=True, order=True)
class Degree:
    """An engine's parallel degree: tensor x pipeline ranks, one device each."""

    tp: int
    pp: int = 1

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class PoolPlacement:
    role: str  # mixed, prefill or decode
    replicas: int
    degree: Degree

    @property
    def devices(self) -> int:
        return self.replicas * self.degree.devices


@dataclass(frozen=True)
class Placement:
    """One candidate: a shape's template with these pools."""

    shape: str
    pools: tuple[PoolPlacement, ...]

    @property
    def devices(self) -> int:
        return sum(pool.devices for pool in self.pools)

    @property
    def engines(self) -> int:
        return sum(pool.replicas for pool in self.pools)

    @property
    def label(self) -> str:
        """``dp 4 x TP2``, ``pd 6:2 x TP1``, ``tp TP4``."""
        degree = self.pools[0].degree
        if self.shape in ONE_ENGINE_SHAPES:
            return f"{self.shape} {degree}"
        counts = ":".join(str(pool.replicas) for pool in self.pools)
        return f"{self.shape} {counts} x {degree}"

    @property
    def slug(self) -> str:
        pools = "-".join(
            f"{pool.role[0]}{pool.replicas}tp{pool.degree.tp}pp{pool.degree.pp}"
            for pool in self.pools
        )
        return f"{self.shape}-{pools}"


def profile_degrees(profile: str) -> list[Degree]:
    """The degrees a profile covers: a shipped family's members, or one profile's own."""
    if Path(profile).exists() or profile in shipped_profiles():
        one = load_profile(profile)
        return [Degree(one.tensor_parallel_size, one.pipeline_parallel_size)]
    prefix = f"{profile}-tp"
    degrees = []
    for name in shipped_profiles():
        if name.startswith(prefix):
            tp, _, pp = name.removeprefix(prefix).partition("-pp")
            degrees.append(Degree(int(tp), int(pp)))
    if not degrees:
        raise ValueError(f"{profile!r}: neither a profile file nor a shipped profile family")
    return sorted(degrees)


def placements(devices: int, degrees: Sequence[Degree], shapes: Sequence[str]) -> list[Placement]:
    """Every candidate that takes exactly ``devices`` devices, for the shapes asked, as
    the config's shapes allow them (one engine of TP and PP both has no shape,
    and dp's engines are not pipelined)."""
    found: list[Placement] = []
    for shape in shapes:
        if shape in ONE_ENGINE_SHAPES:
            found += [
                Placement(shape, (PoolPlacement("mixed", 1, degree),))
                for degree in degrees
                if degree.devices == devices and _one_engine_shape(degree) == shape
            ]
        elif shape in REPLICA_SHAPES:
            found += [
                Placement(shape, (PoolPlacement("mixed", devices // degree.devices, degree),))
                for degree in degrees
                if devices % degree.devices == 0
                and devices // degree.devices >= MIN_REPLICAS
                and (shape != "dp" or degree.pp == 1)
            ]
        elif shape in PD_SHAPES:
            found += _split_placements(shape, devices, degrees)
        else:
            raise ValueError(f"no placement search for shape {shape!r}; searched: {SEARCH_SHAPES}")
    return found


def _one_engine_shape(degree: Degree) -> str | None:
    if degree.devices == 1:
        return "single"
    if degree.pp == 1:
        return "tp"
    return "pp" if degree.tp == 1 else None


def _split_placements(shape: str, devices: int, degrees: Sequence[Degree]) -> list[Placement]:
    found = []
    for degree in degrees:
        engines = devices // degree.devices if devices % degree.devices == 0 else 0
        for prefills in range(1, engines):
            pools = (
                PoolPlacement("prefill", prefills, degree),
                PoolPlacement("decode", engines - prefills, degree),
            )
            found.append(Placement(shape, pools))
    return found


# ---- the YAML of a placement ----------------------------------------------------------------


def placement_document(
    template: dict[str, Any],
    placement: Placement,
    objectives: Objectives,
    accelerator: str = "gpu",
    model: str | None = None,
) -> dict[str, Any]:
    """The shape's template with the placement's pools (each keeping its template pool's
    engine arguments), for ``accelerator``, with the router's objectives set to
    ``objectives``."""
    document = copy.deepcopy(template)
    args = document["applications"][0]["args"]
    by_role = {pool.get("role", "mixed"): pool for pool in args["pools"]}
    args["shape"] = _shape(placement, args["shape"])
    args["pools"] = [
        _pool(by_role.get(pool.role, {}), pool, accelerator) for pool in placement.pools
    ]
    if accelerator == "gpu":
        args["accelerator"] = "gpu"
        args["model"] = {**args.get("model", {}), "dtype": GPU_MODEL_DTYPE}
    if model is not None:
        args["model"] = {**args.get("model", {}), "source": model}
    _set_objectives(args, objectives)
    return document


def _shape(placement: Placement, template_shape: str) -> str:
    if placement.shape in ONE_ENGINE_SHAPES:
        return placement.shape
    return template_shape


def _pool(template: dict[str, Any], pool: PoolPlacement, accelerator: str) -> dict[str, Any]:
    out = {key: value for key, value in template.items() if key not in CPU_ONLY_POOL_KEYS}
    # On CPUs the cache size stays; the template's cpu_binds were for its own engines.
    if accelerator != "gpu" and "kv_cache_gib" in template:
        out["kv_cache_gib"] = template["kv_cache_gib"]
    out["role"] = pool.role
    out["replicas"] = pool.replicas
    out["tensor_parallel_size"] = pool.degree.tp
    out["pipeline_parallel_size"] = pool.degree.pp
    return out


def _set_objectives(args: dict[str, Any], objectives: Objectives) -> None:
    """The router's QoS objective is the user's, and PD's budget for a remote prefill
    half of it (as the templates set it against their own objective)."""
    if objectives.ttft_s is None:
        return
    qos = args.get("qos")
    if isinstance(qos, dict) and qos.get("enabled"):
        qos["ttft_slo_s"] = objectives.ttft_s
        rejection = qos.get("early_rejection_s") or {}
        qos["early_rejection_s"] = {
            priority: min(limit, objectives.ttft_s) for priority, limit in rejection.items()
        }
    policy = args.get("prefill_policy")
    if isinstance(policy, dict) and "remote_ttft_max_s" in policy:
        policy["remote_ttft_max_s"] = objectives.ttft_s / 2


# ---- the profile's error ----------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorBand:
    """A profile's error on the public runs of its device it was never fitted on
    (``held_out_error``: median and worst |simulated / published - 1|, bench/sim_published.py),
    printed beside every figure the search gives. Goodput takes throughput's."""

    goodput: float
    goodput_worst: float
    ttft: float
    tpot: float
    runs: int

    def range_of(self, goodput: float) -> tuple[float, float]:
        return goodput * (1 - self.goodput), goodput * (1 + self.goodput)

    def __str__(self) -> str:
        return (
            f"throughput ±{self.goodput:.0%} (worst {self.goodput_worst:.0%}), TTFT p50"
            f" ±{self.ttft:.0%}, TPOT p50 ±{self.tpot:.0%}: medians over {self.runs} held-out"
            " public runs"
        )


def error_band(profile: str) -> ErrorBand | None:
    """The band of ``profile`` (a file, a shipped profile or a family, whose members
    share their device's fit); none where it was never checked on held-out runs."""
    if Path(profile).exists() or profile in shipped_profiles():
        one = load_profile(profile)
    else:
        first = profile_degrees(profile)[0]
        one = load_profile(f"{profile}-tp{first.tp}-pp{first.pp}")
    error = one.held_out_error
    if "output_tokens_per_s median" not in error:
        return None
    return ErrorBand(
        goodput=error["output_tokens_per_s median"],
        goodput_worst=error["output_tokens_per_s worst"],
        ttft=error.get("ttft_p50_ms median", math.nan),
        tpot=error.get("tpot_p50_ms median", math.nan),
        runs=len(one.held_out_runs),
    )


# ---- the search -----------------------------------------------------------------------------


@dataclass
class Searched:
    """One candidate's knee search."""

    placement: Placement
    knee: KneeResult
    wall_s: float = 0.0
    error: str | None = None  # why it could not be simulated (then its goodput is 0)

    @property
    def goodput(self) -> float:
        """Requests/s within the objectives: the highest rate that met the attainment."""
        knee = self.knee.knee
        return knee.qps if knee is not None else 0.0

    @property
    def at_knee(self) -> KneeStep | None:
        return self.knee.knee


@dataclass
class SearchResult:
    devices: int
    profile: str
    searched: list[Searched] = field(default_factory=list)
    winner: Searched | None = None
    reason: str = ""
    wall_s: float = 0.0
    workload: str = ""  # its label
    mean_lengths: tuple[float, float] = (0.0, 0.0)  # prompt and output tokens
    band: ErrorBand | None = None  # the profile's held-out error

    @property
    def runs(self) -> int:
        return sum(len(s.knee.steps) for s in self.searched)

    @property
    def ranked(self) -> list[Searched]:
        return sorted(self.searched, key=lambda s: (-s.goodput, _simplicity(s.placement)))


# One offline run of the candidate at a rate, as a step of the knee search.
StepAt = Callable[[Placement, float], Awaitable[KneeStep]]
Progress = Callable[[Searched], None]


async def search(
    candidates: Sequence[Placement],
    step_at: StepAt,
    knee: KneeSearchConfig,
    profile: str,
    progress: Progress | None = None,
    band: ErrorBand | None = None,
) -> SearchResult:
    if not candidates:
        raise ValueError("no placement to search")
    result = SearchResult(candidates[0].devices, profile, band=band)
    started = time.perf_counter()
    start = knee.qps_start
    for placement in candidates:
        began = time.perf_counter()

        async def run_at(qps: float, placement: Placement = placement) -> KneeStep:
            return await step_at(placement, qps)

        config = knee.model_copy(update={"qps_start": start})
        try:
            searched = Searched(placement, await find_knee(run_at, config))
        except RunError as error:  # its YAML refused, say: the others still count
            searched = Searched(placement, KneeResult(config.model_dump()), error=str(error))
        searched.wall_s = time.perf_counter() - began
        result.searched.append(searched)
        start = max(start, _round_rate(searched.goodput))
        if progress is not None:
            progress(searched)
    result.wall_s = time.perf_counter() - started
    result.winner, result.reason = choose(result.searched, band)
    return result


def _round_rate(qps: float) -> float:
    """Two significant digits, rounded down, so the steps' rates read plainly."""
    if qps <= 0:
        return 0.0
    unit = 10.0 ** (math.floor(math.log10(qps)) - 1)
    return math.floor(qps / unit) * unit


def choose(searched: Sequence[Searched], band: ErrorBand | None = None) -> tuple[Searched, str]:
    tie = max(TIE_SHARE, band.goodput) if band is not None else TIE_SHARE
    chosen, best = simplest_near_best(searched, lambda s: s.goodput, _simplicity, tie)
    if best.goodput <= 0:
        return chosen, "no placement met the objectives at any rate tried"
    if chosen.goodput == best.goodput:
        ranked = sorted(searched, key=lambda s: (-s.goodput, _simplicity(s)))
        runner_up = next((s for s in ranked if s is not chosen and s.goodput > 0), None)
        margin = (
            f", {chosen.goodput / runner_up.goodput:.2f}x the next ({runner_up.placement.label})"
            if runner_up is not None
            else ""
        )
        return chosen, f"the highest goodput: {chosen.goodput:.1f} req/s{margin}"
    within = "the profile's held-out error" if tie > TIE_SHARE else "the search's resolution"
    return chosen, (
        f"within {tie:.0%} ({within}) of {best.placement.label} ({chosen.goodput:.1f} vs"
        f" {best.goodput:.1f} req/s) with fewer moving parts"
    )


def _simplicity(searched: Searched | Placement) -> tuple[int, int]:
    placement = searched.placement if isinstance(searched, Searched) else searched
    order = SIMPLICITY.index(placement.shape) if placement.shape in SIMPLICITY else len(SIMPLICITY)
    return order, placement.engines
