"""``python -m loadgen advise``: which shape to serve a workload with, from measurements.

Input: a sweep's runs (``runs/*.json`` of ``python -m loadgen sweep``; ``--smoke`` runs a
small one first) and the service-level objectives. The method is DistServe's
goodput-optimal placement, simplified where said:

1. **Goodput per device, per shape.** For every shape, the share of each run's requests
   that met every SLO is recomputed from the run's per-request records (the SLOs given
   now, not the sweep's); a shape's goodput is the highest request rate whose share is at
   least ``--attainment`` (linear between the two measured rates around the first
   miss: a sweep's rates, not a search; ``python -m loadgen knee`` searches finely),
   divided by the devices the shape's YAML takes. The shape with the highest goodput per
   device wins; shapes within 5% of it count as equal and the simplest is chosen
   (single, dp, tp, pp, pd_always, pd, auto). DistServe searches parallelism per phase
   too; here the candidates are the YAMLs the sweep measured.
2. **PD, fitted to measured rates.** From the PD runs: seconds of prefill per token
   and decode step time (the router's own estimates, exported as gauges), decode step
   against decode batch (a line fitted through the runs, batch by Little's law: rate x
   output tokens x TPOT), and transfer time per request (the KV connector's
   histograms). Then, with ``s`` the prefill seconds per token, ``step(B)`` the decode
   step at batch ``B``, and the SLOs:
   - prefill capacity ``C_p = 1 / (mean prompt tokens x s)`` req/s per prefill engine;
     decode capacity ``C_d = B* / (mean output tokens x step(B*))`` at the largest
     batch ``B*`` with ``step(B*) <= TPOT SLO``; P:D = ``C_d : C_p`` (DistServe's
     ratio, without its simulator);
   - ``prompt_length_threshold = TPOT SLO / s``: a longer prompt prefilled on the
     decode engine stalls its running decodes past their TPOT objective (never, when a
     transfer costs more than prefilling the prompt again);
   - ``prefill_queue_max = TTFT SLO / (mean prompt tokens x s)``: queued prompts at
     which a remote prefill would miss the TTFT objective;
   - ``decode_load_threshold = B*``; ``decode_busy_min_length = step(1) / s``;
   - QoS: ``ttft_slo_s`` the objective; low priority refused above
     ``TTFT SLO - mean prompt tokens x s``, the room for one prompt ahead of it.
3. **Sizing** (``loadgen/study/sizing.py``, ``loadgen/study/deployment_plan.py``): the winner's
   engines for a target rate or a device budget (PD: pools in the fitted ratio, scaled
   to the measured level), each engine's tensor-parallel degree raised to what the
   model's weights need on the target device, and every shape's best layout at each
   device count (the Pareto front).
4. **Output.** The winner's YAML with those values under ``deployments/`` and what it
   was chosen for (``router.traffic_profile``: mean lengths and the winner's knee; the
   router reports drift from it), and a report (markdown and PNG) with every
   candidate's measured goodput and why the winner won.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from loadgen.study import deployment_plan, sizing
from loadgen.study.deployment_plan import DeployTarget, Plan
from loadgen.study.sizing import Layout, MeasuredSize, ModelDims, PDCapacities

# Simplest first: the tie-break between shapes within TIE_SHARE of the best.
# auto last: it carries both dp's engines and pd's hand-over, and decides per request.
SIMPLICITY = ("single", "dp", "tp", "pp", "pd_always", "pd", "auto")
TIE_SHARE = 0.05
PD_SHAPES = ("pd", "pd_always")
T = TypeVar("T")


@dataclass(frozen=True)
class Objectives:
    ttft_s: float | None
    tpot_s: float | None
    attainment: float

    def met(self, request: dict[str, Any]) -> bool:
        if request.get("outcome") != "ok" or request.get("ttft_s") is None:
            return False
        if self.ttft_s is not None and request["ttft_s"] > self.ttft_s:
            return False
        tpot = request.get("tpot_s")
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class RunPoint:
    """One measured run, as the advisor reads it."""

    shape: str
    workload: str
    qps: float
    attainment: float
    throughput: float
    mean_input: float
    mean_output: float
    tpot_p50_s: float | None = None
    prefill_s_per_token: float | None = None
    decode_step_s: float | None = None
    transfer_s_per_request: float | None = None
    repeat: str = "."  # which repeat of the sweep measured it (its folder)


@dataclass
class Candidate:
    shape: str
    devices: int
    knee_qps: float  # on the median curve
    curve: list[tuple[float, float]]  # (qps, median attainment over repeats), by qps
    # (qps, lowest, highest attainment) over the repeats, and each repeat's own knee.
    spread: list[tuple[float, float, float]] = field(default_factory=list)
    repeat_knees: list[float] = field(default_factory=list)

    @property
    def goodput_per_device(self) -> float:
        return self.knee_qps / self.devices


@dataclass
class PDFit:
    prefill_s_per_token: float
    step_base_s: float  # step(B) = step_base_s + step_per_request_s * B
    step_per_request_s: float
    transfer_s_per_request: float | None
    max_decode_batch: int
    prefill_capacity: float
    decode_capacity: float
    thresholds: dict[str, Any]
    qos: dict[str, Any]

    @property
    def prefill_per_decode(self) -> float:
        return self.decode_capacity / self.prefill_capacity


@dataclass
class Advice:
    workload: str
    objectives: Objectives
    candidates: list[Candidate]
    winner: str
    reason: str
    pd_fit: PDFit | None = None
    notes: list[str] = field(default_factory=list)
    # The workload as measured, for the YAML's traffic profile (the router's drift check).
    mean_input: float = 0.0
    mean_output: float = 0.0
    plan: Plan | None = None  # the winner sized for the target (plan_for)


# ---- reading a sweep -------------------------------------------------------------------


def load_points(sweep_dir: Path, objectives: Objectives) -> list[RunPoint]:
    """Every finite-rate run of a sweep, its SLO attainment recomputed for ``objectives``.
    Runs in folders below ``sweep_dir`` (``repeat-1/runs/``, ...) are repeats of the
    same cells, each named by its folder."""
    points = []
    for path in sorted(sweep_dir.rglob("runs/*.json")):
        document = json.loads(path.read_text())
        if "requests" not in document:
            continue  # the vLLM-format copy of a run
        point = point_of(
            document, objectives, repeat=str(path.parent.parent.relative_to(sweep_dir))
        )
        if point is not None:
            points.append(point)
    if not points:
        raise ValueError(f"{sweep_dir}: no run with a finite rate in runs/*.json")
    return points


def point_of(
    document: dict[str, Any], objectives: Objectives, repeat: str = "."
) -> RunPoint | None:
    qps = float(document["qps"]) if document["qps"] not in ("inf", "replay") else math.inf
    if not math.isfinite(qps):
        return None  # an unlimited run has no rate to place on the curve
    requests = [r for r in document["requests"] if not r.get("warmup")]
    row = document.get("summary_row", {})
    workload = document["workload"]
    return RunPoint(
        shape=document["shape"],
        workload=workload["label"],
        qps=qps,
        attainment=sum(objectives.met(r) for r in requests) / max(1, len(requests)),
        throughput=float(document["summary"]["request_throughput"]),
        mean_input=float(workload["mean_input_tokens"]),
        mean_output=float(workload["mean_output_tokens"]),
        tpot_p50_s=_ms_to_s(row.get("tpot_p50_ms")),
        prefill_s_per_token=row.get("prefill_s_per_token"),
        decode_step_s=row.get("decode_step_s"),
        transfer_s_per_request=document.get("server", {}).get("kv_transfer_s_per_request"),
        repeat=repeat,
    )


def _ms_to_s(value: Any) -> float | None:
    return (
        None if value is None or (isinstance(value, float) and math.isnan(value)) else value / 1000
    )


def layout_of(shape: str, deployments_dir: Path) -> Layout:
    """Each pool's role and replicas, and the ranks per engine (tensor x pipeline
    parallel), of the shape's YAML: its devices are GPUs on a GPU node, cores here."""
    document = yaml.safe_load((deployments_dir / f"{shape}.yaml").read_text())
    pools = document["applications"][0]["args"]["pools"]
    roles = tuple((p.get("role", "mixed"), p.get("replicas", 1)) for p in pools)
    ranks = max(
        p.get("tensor_parallel_size", 1) * p.get("pipeline_parallel_size", 1) for p in pools
    )
    return Layout(roles, ranks)


# ---- choosing --------------------------------------------------------------------------


def knee_of(curve: list[tuple[float, float]], target: float) -> float:
    """The highest rate meeting ``target``, linear up to the first miss after it."""
    curve = sorted(curve)
    knee = 0.0
    for index, (qps, attainment) in enumerate(curve):
        if attainment >= target:
            knee = qps
            continue
        if index > 0 and curve[index - 1][1] >= target:
            previous_qps, previous = curve[index - 1]
            share = (previous - target) / (previous - attainment)
            knee = previous_qps + share * (qps - previous_qps)
        break
    return knee


def advise(points: list[RunPoint], objectives: Objectives, devices: dict[str, int]) -> Advice:
    workloads = sorted({p.workload for p in points})
    if len(workloads) != 1:
        raise ValueError(f"advise one workload at a time; the runs hold {workloads}")
    by_shape: dict[str, list[RunPoint]] = defaultdict(list)
    for point in points:
        by_shape[point.shape].append(point)
    candidates = [
        candidate_of(shape, runs, devices[shape], objectives.attainment)
        for shape, runs in sorted(by_shape.items())
    ]
    winner, reason = choose(candidates)
    pd_runs = [p for p in points if p.shape in PD_SHAPES]
    advice = Advice(
        workloads[0],
        objectives,
        candidates,
        winner,
        reason,
        mean_input=sum(p.mean_input for p in points) / len(points),
        mean_output=sum(p.mean_output for p in points) / len(points),
    )
    if pd_runs:
        try:
            advice.pd_fit = fit_pd(pd_runs, objectives)
        except ValueError as error:
            advice.notes.append(f"PD not fitted: {error}")
    return advice


def candidate_of(shape: str, runs: list[RunPoint], devices: int, target: float) -> Candidate:
    """A shape's curve: the median attainment at each rate over the repeats, its knee, and
    the spread (each rate's lowest and highest, each repeat's own knee)."""
    by_rate: dict[float, list[float]] = defaultdict(list)
    by_repeat: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in runs:
        by_rate[run.qps].append(run.attainment)
        by_repeat[run.repeat].append((run.qps, run.attainment))
    curve = [(qps, statistics.median(shares)) for qps, shares in sorted(by_rate.items())]
    return Candidate(
        shape,
        devices,
        knee_of(curve, target),
        curve,
        spread=[(qps, min(shares), max(shares)) for qps, shares in sorted(by_rate.items())],
        repeat_knees=[knee_of(points, target) for _, points in sorted(by_repeat.items())],
    )


def simplest_near_best(
    items: Sequence[T],
    goodput: Callable[[T], float],
    simplicity: Callable[[T], Any],
    tie: float = TIE_SHARE,
) -> tuple[T, T]:
    """The simplest item within ``tie`` (a share) of the highest goodput (the simplest of
    all where none has any goodput), and the item with the highest."""
    top = max(items, key=goodput)
    if goodput(top) <= 0:
        return min(items, key=simplicity), top
    close = [item for item in items if goodput(item) >= (1 - tie) * goodput(top)]
    return min(close, key=simplicity), top


def choose(candidates: list[Candidate]) -> tuple[str, str]:
    chosen, top = simplest_near_best(
        candidates, lambda c: c.goodput_per_device, lambda c: _simplicity(c.shape)
    )
    if top.goodput_per_device <= 0:
        return chosen.shape, "no shape met the objectives at any measured rate"
    if chosen.shape == top.shape:
        runner_up = sorted(candidates, key=lambda c: -c.goodput_per_device)[1:2]
        margin = (
            f", {chosen.goodput_per_device / runner_up[0].goodput_per_device:.2f}x"
            f" {runner_up[0].shape}'s"
            if runner_up and runner_up[0].goodput_per_device > 0
            else ""
        )
        return chosen.shape, (
            f"the highest goodput per device: {chosen.goodput_per_device:.2f} req/s{margin}"
        )
    return chosen.shape, (
        f"within {TIE_SHARE:.0%} of {top.shape}'s goodput per device"
        f" ({chosen.goodput_per_device:.2f} vs {top.goodput_per_device:.2f} req/s) and simpler"
    )


def _simplicity(shape: str) -> int:
    return SIMPLICITY.index(shape) if shape in SIMPLICITY else len(SIMPLICITY)


def fit_pd(runs: list[RunPoint], objectives: Objectives) -> PDFit:
    per_token = [p.prefill_s_per_token for p in runs if p.prefill_s_per_token]
    if not per_token:
        raise ValueError("the PD runs report no prefill seconds per token (an older router?)")
    s = sorted(per_token)[len(per_token) // 2]
    mean_in = sum(p.mean_input for p in runs) / len(runs)
    mean_out = sum(p.mean_output for p in runs) / len(runs)
    base, slope = _fit_step(runs)
    tpot_slo = objectives.tpot_s or max(base + slope * 8, base * 2)
    ttft_slo = objectives.ttft_s or 10 * mean_in * s
    max_batch = max(1, int((tpot_slo - base) / slope)) if slope > 0 else 256
    max_batch = min(max_batch, 1024)
    step_at_max = base + slope * max_batch
    prefill_capacity = 1.0 / (mean_in * s)
    decode_capacity = max_batch / (mean_out * max(step_at_max, 1e-9))
    transfers = [p.transfer_s_per_request for p in runs if p.transfer_s_per_request]
    transfer = sorted(transfers)[len(transfers) // 2] if transfers else None
    # Prefilling remotely pays only if moving the KV costs less than computing the prompt again.
    worth_moving = transfer is None or transfer < mean_in * s
    threshold = math.ceil(tpot_slo / s) if worth_moving else 1_000_000
    thresholds = {
        "prompt_length_threshold": max(1, threshold),
        "prefill_queue_max": max(1, int(ttft_slo / (mean_in * s))),
        "decode_load_threshold": max_batch,
        "decode_busy_min_length": max(1, math.ceil(max(base + slope, 1e-9) / s)),
    }
    low_limit = max(ttft_slo - mean_in * s, 0.05 * ttft_slo)
    qos = {
        "enabled": True,
        "ttft_slo_s": round(ttft_slo, 4),
        "early_rejection_s": {"low": round(min(low_limit, ttft_slo), 4)},
    }
    return PDFit(
        s, base, slope, transfer, max_batch, prefill_capacity, decode_capacity, thresholds, qos
    )


def _fit_step(runs: list[RunPoint]) -> tuple[float, float]:
    """step(B) = base + slope x B through the runs' (decode batch, TPOT) points."""
    points = [
        (p.throughput * p.mean_output * p.tpot_p50_s, p.tpot_p50_s)
        for p in runs
        if p.tpot_p50_s and p.throughput > 0
    ]
    if not points:
        steps = [p.decode_step_s for p in runs if p.decode_step_s]
        if not steps:
            raise ValueError("the PD runs measured no decode step")
        return sorted(steps)[len(steps) // 2], 0.0
    if len(points) == 1 or len({round(b, 6) for b, _ in points}) == 1:
        return points[0][1], 0.0
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    covariance = sum((b - mean_b) * (t - mean_t) for b, t in points)
    variance = sum((b - mean_b) ** 2 for b, _ in points)
    slope = max(0.0, covariance / variance)
    return max(1e-6, mean_t - slope * mean_b), slope


# ---- output ----------------------------------------------------------------------------


def plan_for(
    advice: Advice,
    layouts: dict[str, Layout],
    target: DeployTarget,
    shape: ModelDims | None = None,
) -> Plan:
    """Size the winner for ``target`` (``layouts``: each shape's YAML as measured); the
    plan is kept on ``advice``."""
    measured = [MeasuredSize(c.shape, c.knee_qps, layouts[c.shape]) for c in advice.candidates]
    fit = advice.pd_fit
    capacities = None if fit is None else PDCapacities(fit.prefill_capacity, fit.decode_capacity)
    advice.plan = deployment_plan.plan_deployment(
        measured, advice.winner, capacities, target, shape
    )
    return advice.plan


def write_yaml(
    advice: Advice, deployments_dir: Path, path: Path, target: DeployTarget | None = None
) -> Path:
    """The winner's YAML, with the fitted PD thresholds where the winner is PD, the
    traffic profile it was chosen for, and its pools sized for ``target``."""
    document = yaml.safe_load((deployments_dir / f"{advice.winner}.yaml").read_text())
    args = document["applications"][0]["args"]
    if advice.winner in PD_SHAPES and advice.pd_fit is not None:
        fit = advice.pd_fit
        if advice.winner == "pd":
            args["prefill_policy"] = {"name": "conditional", **fit.thresholds}
        args["qos"] = {**args.get("qos", {}), **fit.qos}
    args.setdefault("router", {})["traffic_profile"] = traffic_profile(advice)
    header = (
        f"# Written by python -m loadgen advise for workload {advice.workload}:"
        f" {advice.winner}, {advice.reason}.\n"
    )
    sized = advice.plan.sizing if advice.plan is not None else None
    if sized is not None:
        header += (
            f"# Sized: {sized.devices} device(s), {_engines_text(sized.engines)}, tensor x"
            f" pipeline parallel {sized.ranks_per_engine} each, for"
            f" {sized.goodput:.2f} req/s within the objectives"
            f" ({'measured' if sized.measured else 'fitted'}).\n"
        )
    plan = advice.plan or Plan(None, [])
    return deployment_plan.write_yaml(plan, document, target or DeployTarget(), header, path)


def _engines_text(engines: dict[str, int]) -> str:
    return ", ".join(f"{count} {role}" for role, count in engines.items()) + " engine(s)"


def traffic_profile(advice: Advice) -> dict[str, float]:
    """What the winner was chosen for, as ``router.traffic_profile``: the router reports
    how far live traffic drifts from it."""
    profile = {
        "prompt_tokens": round(advice.mean_input, 1),
        "output_tokens": round(advice.mean_output, 1),
    }
    knee = next(c.knee_qps for c in advice.candidates if c.shape == advice.winner)
    if advice.plan is not None and advice.plan.sizing is not None:
        knee = advice.plan.sizing.goodput  # what the sized deployment is expected to serve
    if knee > 0:
        profile["request_rate"] = round(knee, 3)
    return profile


def write_report(advice: Advice, out_dir: Path, yaml_path: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    png = plot_advice(advice, out_dir / "advice.png")
    objectives = advice.objectives
    slo = ", ".join(
        text
        for text in (
            objectives.ttft_s is not None and f"TTFT <= {objectives.ttft_s * 1000:.0f} ms",
            objectives.tpot_s is not None and f"TPOT <= {objectives.tpot_s * 1000:.1f} ms",
        )
        if text
    )
    lines = [
        f"# Shape advice for {advice.workload}",
        "",
        f"Objectives: {slo}, for {objectives.attainment:.0%} of requests.",
        "",
        f"**Serve it as `{advice.winner}`**: {advice.reason}. YAML: `{yaml_path}`.",
        "",
        "Measured: every shape's share of requests within the objectives at each rate (the"
        " median over the sweep's repeats, lowest-highest in brackets) and its goodput (the"
        " knee of that curve). Fitted: PD's per-engine capacities and P:D, and every goodput"
        " at a size the sweep did not run.",
        "",
        "| shape | devices | goodput (req/s) | per device | knee over repeats |"
        " measured (req/s: share met) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(advice.candidates, key=lambda c: -c.goodput_per_device):
        lines.append(
            f"| {c.shape} | {c.devices} | {c.knee_qps:.2f} | {c.goodput_per_device:.2f} |"
            f" {_knee_spread(c)} | {_curve_text(c)} |"
        )
    if advice.pd_fit is not None:
        fit = advice.pd_fit
        lines += [
            "",
            "## PD, fitted to the measured rates",
            "",
            f"- prefill: {fit.prefill_s_per_token * 1000:.4f} ms per prompt token"
            f" ({fit.prefill_capacity:.2f} req/s per prefill engine)",
            f"- decode step: {fit.step_base_s * 1000:.2f} ms + {fit.step_per_request_s * 1000:.3f}"
            f" ms per request in the batch; largest batch within the TPOT objective"
            f" {fit.max_decode_batch} ({fit.decode_capacity:.2f} req/s per decode engine)",
            "- KV transfer: "
            + (
                f"{fit.transfer_s_per_request * 1000:.2f} ms per request"
                if fit.transfer_s_per_request is not None
                else "not measured"
            ),
            f"- P:D = 1 : {1 / fit.prefill_per_decode:.2f} (prefill engines per decode engine"
            f" {fit.prefill_per_decode:.2f})",
            f"- prefill_policy: {fit.thresholds}",
            f"- qos: {fit.qos}",
        ]
    if advice.plan is not None:
        lines += _plan_lines(advice.plan)
    lines += ["", *[f"- note: {note}" for note in advice.notes], "", f"![goodput]({png.name})"]
    markdown = out_dir / "advice.md"
    markdown.write_text("\n".join(lines) + "\n")
    (out_dir / "advice.json").write_text(json.dumps(_jsonable(advice), indent=1))
    return markdown, png


def _knee_spread(candidate: Candidate) -> str:
    knees = candidate.repeat_knees
    if len(knees) < 2:
        return "one run a rate"
    return f"{min(knees):.2f}-{max(knees):.2f} ({len(knees)} repeats)"


def _curve_text(candidate: Candidate) -> str:
    spread = {qps: (low, high) for qps, low, high in candidate.spread}
    parts = []
    for qps, share in candidate.curve:
        low, high = spread.get(qps, (share, share))
        bracket = f" [{low:.0%}-{high:.0%}]" if high > low else ""
        parts.append(f"{qps:g}: {share:.0%}{bracket}")
    return ", ".join(parts)


def _plan_lines(plan: Plan) -> list[str]:
    lines = ["", "## Deployment", ""]
    sized = plan.sizing
    if sized is None:
        lines.append(
            "- not sized: the winner met the objectives at no rate, or the budget is short"
        )
    else:
        lines.append(
            f"- {sized.devices} device(s): {_engines_text(sized.engines)}, parallel degree"
            f" {sized.ranks_per_engine} each, {sized.goodput:.2f} req/s within the objectives"
            f" ({'measured' if sized.measured else 'fitted from ' + sized.measured_shape})"
        )
    if plan.tp_degrees:
        lines.append(f"- tensor-parallel degrees the model allows: {plan.tp_degrees}")
    lines += [f"- {note}" for note in plan.notes]
    front = sizing.pareto_front(plan.pareto)
    if front:
        lines += [
            "",
            "Goodput against devices, the best layout at each size (the Pareto front):",
            "",
            "| devices | layout | goodput (req/s) | basis |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {p.devices} | {p.shape}: {_engines_text(p.engines)} | {p.goodput:.2f} |"
            f" {'measured' if p.measured else 'fitted'} |"
            for p in front
        ]
    return lines


def _jsonable(advice: Advice) -> dict[str, Any]:
    document = asdict(advice)
    document["candidates"] = [
        {**asdict(c), "goodput_per_device": c.goodput_per_device} for c in advice.candidates
    ]
    return document


def _plot_pareto(axes: Any, plan: Plan | None) -> None:
    """Goodput against devices: each shape's layouts (filled where measured, hollow where
    fitted) and the front no layout beats with fewer devices."""
    axes.set_title("goodput against devices")
    axes.set_xlabel("devices")
    axes.set_ylabel("goodput (req/s)")
    if plan is None or not plan.pareto:
        axes.text(0.5, 0.5, "not sized", ha="center", transform=axes.transAxes)
        return
    by_shape: dict[str, list[Any]] = defaultdict(list)
    for point in plan.pareto:
        by_shape[point.measured_shape].append(point)
    for shape, points in sorted(by_shape.items()):
        points.sort(key=lambda p: p.devices)
        line = axes.plot([p.devices for p in points], [p.goodput for p in points], "-",
                         alpha=0.5, label=shape)[0]  # fmt: skip
        for point in points:
            face = line.get_color() if point.measured else "none"
            axes.plot(point.devices, point.goodput, "o", color=line.get_color(), mfc=face)
    front = sizing.pareto_front(plan.pareto)
    axes.step([p.devices for p in front], [p.goodput for p in front], where="post",
              color="black", linewidth=1.5, label="Pareto front")  # fmt: skip
    if plan.sizing is not None:
        axes.plot(plan.sizing.devices, plan.sizing.goodput, "*", markersize=14,
                  color="tab:green", label="advised")  # fmt: skip
    axes.legend()


def plot_advice(advice: Advice, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bars, curves, pareto) = plt.subplots(1, 3, figsize=(16, 4))
    ordered = sorted(advice.candidates, key=lambda c: -c.goodput_per_device)
    colors = ["tab:green" if c.shape == advice.winner else "tab:grey" for c in ordered]
    bars.bar([c.shape for c in ordered], [c.goodput_per_device for c in ordered], color=colors)
    bars.set_ylabel("goodput per device (req/s)")
    bars.set_title(f"{advice.workload}: {advice.winner} wins")
    for candidate in advice.candidates:
        qps, attainment = zip(*candidate.curve, strict=True)
        line = curves.plot(qps, [100 * a for a in attainment], "o-", label=candidate.shape)[0]
        if any(high > low for _, low, high in candidate.spread):
            rates, lows, highs = zip(*candidate.spread, strict=True)
            curves.fill_between(
                rates, [100 * v for v in lows], [100 * v for v in highs],
                color=line.get_color(), alpha=0.15,
            )  # fmt: skip
    curves.axhline(100 * advice.objectives.attainment, linestyle=":", color="grey")
    curves.set_xlabel("offered load (req/s)")
    curves.set_ylabel("requests within the objectives (%)")
    curves.legend()
    _plot_pareto(pareto, advice.plan)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
