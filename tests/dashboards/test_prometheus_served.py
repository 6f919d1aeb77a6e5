"""End to end: pd.yaml, a real Prometheus with dashboards/prometheus.yml, a short load
generator run, then every query of the Grafana dashboard through Prometheus's HTTP API.

Also: every metric the dashboard names exists in what Prometheus scraped, the scraped
pages pass ``promtool check metrics``, the engines' utilization samplers tick every
200 ms, and Prometheus evaluates dashboards/alerts.yml. Ray exports engine-side metrics
every 2 s in the test session (conftest's RAY_METRICS_EXPORT_MS; Ray's default is
10 s), so queries use a window that holds several exports and are retried until they
have data.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from rich.console import Console

from dashboards.dashboard import build_dashboard, expand, expressions, metric_names
from dashboards.prometheus import (
    CONFIG_TEMPLATE,
    RAY_JOB,
    RunningPrometheus,
    ScrapeTargets,
    ensure_prometheus,
    ray_discovery_file,
    run_prometheus,
    target_health,
)
from engines.sampler import SAMPLE_PERIOD_S
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.outputs.exposition import Exposition
from loadgen.scheduling.runner import RunResult, execute_run
from tests.support.local_ports import free_port
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

SCRAPE_INTERVAL = "1s"
# Ray's endpoints as dashboards/prometheus.yml scrapes them. Late in a full run the
# session's Ray cluster holds the series of every application the suite started: its
# page took 1.23 s (0.32 s on a fresh cluster), and at a 1 s timeout its scrapes failed
# often enough that series went stale; 3 s leaves room for that.
RAY_SCRAPE_INTERVAL = "3s"
# Two minutes hold dozens of Ray's exports, so rate() has points from the run even when
# a busy machine delays an export or two.
RATE_WINDOW = "2m"
DATA_TIMEOUT_S = 120.0
POLL_S = 2.0
# Above the conditional split's prompt_length_threshold (256), so prompts go remote.
INPUT_LEN, OUTPUT_LEN = 512, 16
# 16 s of load: Ray exports the engines' metrics at least once while it runs.
REQUESTS, RATE = 24, 1.5
PREFIX_REPEATS = 3
# The samplers run beside busy engines on two cores: allow them to lose a fifth of ticks.
MIN_TICK_SHARE = 0.8
# Export points are read at scrape times, a second or so after each export.
MAX_TICK_SHARE = 1.1
# Each scrape of Ray's endpoint (every 3 s) reads the last export (every 2 s), up to 2 s
# old: the rate is the slope through ten changed points (27 s), which such lags move by
# about 2.5% (one standard deviation), not ten (CI once saw 5.56 ticks/s from three
# points 18 s apart).
MIN_EXPORTS = 10
# Exist only where NVML answers (GPU engines); here the CPU fallback stands in for them.
PD_REPLICAS = {"prefill-0", "decode-0"}
GPU_ONLY = {
    "splitserve_gpu_utilization_percent",
    "splitserve_gpu_memory_used_bytes",
    "splitserve_gpu_busy_seconds_total",
}
# Families of ours (and vLLM's) on Ray's per-node endpoint, before the renaming.
RAY_FAMILIES = ("ray_splitserve_", "ray_vllm_")
# Serve's error counters: Ray creates a series at its first error, and this run may have none.
SERVE_ERRORS_ONLY = {
    "ray_serve_num_deployment_http_error_requests_total",
    "ray_serve_deployment_error_counter_total",
}
# Labels Ray puts on every series (and vLLM's ReplicaId): promtool wants snake_case.
FOREIGN_LABELS = re.compile(
    r',?\b(?:Component|NodeAddress|SessionName|Version|WorkerId|ReplicaId|otel_scope_\w+)="[^"]*"'
)
# vLLM's own names that promtool objects to; not ours to rename (vllm/v1/metrics/loggers.py).
VLLM_UPSTREAM_LINT = {
    "ray_vllm_iteration_tokens_total": "a histogram named like a counter (_total)",
}


@pytest.fixture(scope="module")
def loadgen_metrics() -> tuple[Exposition, int]:
    exposition, port = Exposition(), free_port()
    exposition.serve(port)
    return exposition, port


@pytest.fixture(scope="module")
def stack(
    ray_address: str,
    served_apps: ServedApps,
    loadgen_metrics: tuple[Exposition, int],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, RunningPrometheus, RunResult]]:
    """pd.yaml, Prometheus scraping it, and one finished load-generator run."""
    exposition, loadgen_port = loadgen_metrics
    app = served_apps.get("pd")
    targets = ScrapeTargets(
        router=app.base_url.removeprefix("http://"),
        ray_discovery_file=ray_discovery_file(ray_address),
        loadgen=f"127.0.0.1:{loadgen_port}",
        scrape_interval=SCRAPE_INTERVAL,
        ray_scrape_interval=RAY_SCRAPE_INTERVAL,
    )
    work_dir = tmp_path_factory.mktemp("prometheus")
    with run_prometheus(targets, port=free_port(), work_dir=work_dir) as prometheus:
        config = RunConfig(
            base_url=app.base_url,
            workload=WorkloadConfig(name="custom", input_len=INPUT_LEN, output_len=OUTPUT_LEN),
            qps=RATE,
            num_requests=REQUESTS,
            warmup_requests=1,
            show_progress=False,
            prometheus_url=prometheus.url,
        )
        result = asyncio.run(execute_run(config, Console(quiet=True), exposition))
        _repeat_one_prompt(app.base_url, result.model)
        yield app.base_url, prometheus, result


def _repeat_one_prompt(base_url: str, model: str) -> None:
    """The load's prompts are random: send one prompt again so prefix caches have hits."""
    body = {"model": model, "prompt": list(range(INPUT_LEN)), "max_tokens": OUTPUT_LEN}
    for _ in range(PREFIX_REPEATS):
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text


def _query(prometheus: RunningPrometheus, expr: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus.url}/api/v1/query", params={"query": expr}, timeout=10)
    response.raise_for_status()
    return response.json()["data"]["result"]


def _has_finite_value(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def _has_data(prometheus: RunningPrometheus, expr: str) -> bool:
    return _has_finite_value(_query(prometheus, expand(expr, RATE_WINDOW)))


def test_run_completed_and_all_targets_up(stack: tuple) -> None:
    _, prometheus, result = stack
    assert result.summary.completed == REQUESTS, result.notes
    assert result.shape == "pd"
    health = target_health(prometheus.url)
    assert {t["job"] for t in health} >= {"splitserve-router", "ray", "loadgen"}
    # Each target as of its last scrape: on a loaded box one of Ray's endpoints can miss
    # a 1 s scrape deadline ("context deadline exceeded"); it must be up again soon.
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while not all(t["health"] == "up" for t in health) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        health = target_health(prometheus.url)
    print("targets:", *health, sep="\n  ")  # scrape durations: a full run's Ray page is large
    assert all(t["health"] == "up" for t in health), health


@pytest.fixture(scope="module")
def settled(stack: tuple) -> list[tuple[str, str]]:
    """Polls every dashboard query from the run's end until each has had data; what never did.

    Ray exports engine-side series every export interval and drops an engine's gauges
    two intervals after its last step, so each query is proven by its own first answer
    with data.
    """
    _, prometheus, _ = stack
    started = time.monotonic()
    pending = set(expressions(build_dashboard()))
    while pending:
        pending = {(title, expr) for title, expr in pending if not _has_data(prometheus, expr)}
        if not pending or time.monotonic() > started + DATA_TIMEOUT_S:
            break
        time.sleep(POLL_S)
    print(
        f"dashboard queries: {len(pending)} never had data,"
        f" waited {time.monotonic() - started:.0f}s"
    )
    return sorted((title, expand(expr, RATE_WINDOW)) for title, expr in pending)


def _vllm_series_report(prometheus: RunningPrometheus) -> str:
    """What Prometheus holds of vLLM's counters, per replica, now and two minutes ago:
    tells a stat logger that stopped recording from an export that never arrived."""
    lines = []
    for label, expr in (
        ("series", 'count by (replica) ({__name__=~"vllm:.+"})'),
        ("finished now", "sum by (replica, ReplicaId) (vllm:request_success_total)"),
        ("2 min ago", "sum by (replica, ReplicaId) (vllm:request_success_total offset 2m)"),
        ("samples", "sum by (replica) (splitserve_utilization_samples_total)"),
    ):
        found = _query(prometheus, expr)
        values = {tuple(s["metric"].values()): s["value"][1] for s in found}
        lines.append(f"  {label}: {values}")
    lines += [f"  target: {target}" for target in target_health(prometheus.url)]
    return "\n".join(lines)


def test_every_dashboard_query_returns_data(stack: tuple, settled: list[tuple[str, str]]) -> None:
    _, prometheus, _ = stack
    assert not settled, (
        "queries without a finite value:\n"
        + "\n".join(f"  {title}: {expr}" for title, expr in settled)
        + "\nvLLM's series:\n"
        + _vllm_series_report(prometheus)
    )


VARIABLE_QUERY = re.compile(r"label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)")


def test_every_template_variable_has_values(stack: tuple, settled: list) -> None:
    """Grafana fills each dropdown with label_values(metric, label): ask Prometheus alike."""
    _, prometheus, _ = stack
    empty = []
    for variable in build_dashboard()["templating"]["list"]:
        found = VARIABLE_QUERY.fullmatch(str(variable.get("definition", "")))
        if found is None:
            continue
        response = httpx.get(
            f"{prometheus.url}/api/v1/label/{found['label']}/values",
            params={"match[]": found["metric"]},
            timeout=10,
        )
        response.raise_for_status()
        if not response.json()["data"]:
            empty.append(f"${variable['name']}: {variable['definition']}")
    assert not empty, "template variables with no values:\n" + "\n".join(empty)


def _scraped_names(prometheus: RunningPrometheus) -> set[str]:
    response = httpx.get(f"{prometheus.url}/api/v1/label/__name__/values", timeout=10)
    response.raise_for_status()
    return set(response.json()["data"])


def _sampler_sources(prometheus: RunningPrometheus) -> set[str]:
    # Over the whole run, not at this instant: Ray stops exporting an idle replica's series
    # a while after the load ends, and an instant query then sees none (a CI run did).
    expr = "last_over_time(splitserve_utilization_samples_total[1h])"
    return {s["metric"]["source"] for s in _query(prometheus, expr)}


def test_every_metric_the_dashboard_names_was_scraped(stack: tuple, settled: list) -> None:
    _, prometheus, _ = stack
    named = {name for _, expr in expressions(build_dashboard()) for name in metric_names(expr)}
    # Panels read Ray's names too, for a Prometheus without prometheus.yml's renaming;
    # this one renames them, so only the renamed ones can be here.
    named = {name for name in named if not name.startswith(RAY_FAMILIES)} - SERVE_ERRORS_ONLY
    # A counter vLLM only creates on its first increment (prefix cache hits, from the
    # repeated prompt) reaches Prometheus with Ray's next export, an interval later.
    deadline = time.monotonic() + DATA_TIMEOUT_S
    missing = named - _scraped_names(prometheus)
    while missing - GPU_ONLY and time.monotonic() < deadline:
        time.sleep(POLL_S)
        missing = named - _scraped_names(prometheus)
    if _sampler_sources(prometheus) == {"cpu"}:
        # No NVML here: the GPU families are the documented alternative in each `or`.
        assert missing >= GPU_ONLY, "GPU metrics without NVML?"
        missing -= GPU_ONLY
    assert not missing, f"named by the dashboard, never scraped: {sorted(missing)}"


def _export_points(prometheus: RunningPrometheus, selector: str) -> dict[str, list]:
    """Per replica, the (time, value) points where Ray's export changed the counter.

    rate() over a window longer than Prometheus has been running under-reads; the
    counter's own export points give ticks per second, to a scrape interval. The first
    value is left out: Prometheus read it at its first scrape, not at an export.
    """
    series = _query(prometheus, f"{selector}[10m]")
    points: dict[str, list] = {}
    for item in series:
        values = [(float(t), float(v)) for t, v in item["values"]]
        changes = [b for a, b in itertools.pairwise(values) if b[1] != a[1]]
        # Earlier tests' apps had replicas of the same names, whose last counters Ray's
        # metrics agent keeps exporting for a while, unchanging: the live one ticks.
        replica = item["metric"]["replica"]
        if len(changes) > len(points.get(replica, [])):
            points[replica] = changes
    return points


def test_samplers_tick_every_200_ms_in_every_engine_replica(stack: tuple, settled: list) -> None:
    _, prometheus, _ = stack
    selector = "splitserve_utilization_samples_total"
    deadline = time.monotonic() + DATA_TIMEOUT_S
    points = _export_points(prometheus, selector)
    while (
        min(len(points.get(r, [])) for r in PD_REPLICAS) < MIN_EXPORTS
        and time.monotonic() < deadline
    ):
        time.sleep(POLL_S)
        points = _export_points(prometheus, selector)
    # An earlier test's `engine-0` may still be exported, unchanging.
    assert set(points) >= PD_REPLICAS, sorted(points)
    points = {replica: p for replica, p in points.items() if replica in PD_REPLICAS}
    expected = 1 / SAMPLE_PERIOD_S
    assert min(len(p) for p in points.values()) >= MIN_EXPORTS, points
    per_second = {
        replica: statistics.linear_regression([t for t, _ in p], [v for _, v in p]).slope
        for replica, p in points.items()
    }
    print(f"sampler ticks per second: {per_second} (expected {expected:g})")
    for replica, rate in per_second.items():
        assert MIN_TICK_SHARE * expected <= rate <= MAX_TICK_SHARE * expected, replica
    assert _sampler_sources(prometheus) == {"cpu"}  # no NVML on this machine
    # Engine processes were found: each replica's engine core used CPU.
    cpu = _query(prometheus, "splitserve_cpu_busy_seconds_total")
    processes = {(s["metric"]["replica"], s["metric"]["process"]) for s in cpu}
    assert {("prefill-0", "EngineCore"), ("decode-0", "EngineCore")} <= processes


def test_engine_metrics_carry_replica_and_role(stack: tuple, settled: list) -> None:
    _, prometheus, _ = stack
    # Ray drops an idle engine's gauges two exports after its last step: look back over the run.
    series = _query(prometheus, "last_over_time(vllm:num_requests_running[5m])")
    assert {(s["metric"]["replica"], s["metric"]["role"]) for s in series} == {
        ("prefill-0", "prefill"),
        ("decode-0", "decode"),
    }, _vllm_series_report(prometheus)
    # KV really moved: the decode replica loaded prompt tokens from transfers.
    loaded = _query(
        prometheus,
        'sum by (replica) (vllm:prompt_tokens_by_source_total{source="external_kv_transfer"})',
    )
    assert any(float(s["value"][1]) > 0 for s in loaded), loaded


def _promtool_problems(text: str) -> list[str]:
    _, promtool = ensure_prometheus()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == 0 or lines, f"promtool failed silently: {result.returncode}"
    return lines if result.returncode else []


def _families(text: str, prefixes: tuple[str, ...]) -> str:
    """Only these families, without the labels Ray and vLLM add (CamelCase, not ours)."""
    keep = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
        if name.startswith(prefixes):
            keep.append(FOREIGN_LABELS.sub("", line).replace("{,", "{").replace(",}", "}"))
    return "\n".join(keep) + "\n"


def test_scraped_pages_pass_promtool_check_metrics(
    stack: tuple, loadgen_metrics: tuple[Exposition, int]
) -> None:
    base_url, prometheus, _ = stack
    router = httpx.get(f"{base_url}/metrics", timeout=10).text
    assert "splitserve_requests_total" in router
    assert _promtool_problems(router) == []
    loadgen = httpx.get(f"http://127.0.0.1:{loadgen_metrics[1]}/metrics", timeout=10).text
    assert _promtool_problems(loadgen) == []
    # Ray's endpoints also carry Ray's own metrics; we check ours and vLLM's.
    checked = set()
    for target in target_health(prometheus.url):
        if target["job"] != "ray":
            continue
        page = httpx.get(f"http://{target['address']}/metrics", timeout=10).text
        for prefix in RAY_FAMILIES:
            families = _families(page, (prefix,))
            if not families.strip():
                continue
            checked.add(prefix)
            problems = _promtool_problems(families)
            if prefix == "ray_vllm_":
                problems = [p for p in problems if p.split()[0] not in VLLM_UPSTREAM_LINT]
            assert problems == [], (target["address"], problems)
    assert checked == set(RAY_FAMILIES), f"Ray endpoints exported only {checked}"


def _rule_states(prometheus: RunningPrometheus) -> list[dict[str, Any]]:
    response = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10)
    response.raise_for_status()
    return [rule for group in response.json()["data"]["groups"] for rule in group["rules"]]


def test_prometheus_evaluates_the_alert_rules(stack: tuple) -> None:
    """dashboards/alerts.yml, through the rendered config: every rule loaded and evaluated
    without error (whether one fires depends on this machine's load, so is not checked)."""
    _, prometheus, _ = stack
    groups = yaml.safe_load((CONFIG_TEMPLATE.parent / "alerts.yml").read_text())["groups"]
    expected = {rule["alert"] for group in groups for rule in group["rules"]}
    deadline = time.monotonic() + DATA_TIMEOUT_S
    rules = _rule_states(prometheus)
    while any(r["health"] == "unknown" for r in rules) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        rules = _rule_states(prometheus)
    assert {rule["name"] for rule in rules} == expected
    assert all(rule["health"] == "ok" for rule in rules), rules


def test_loadgen_server_view_reads_prometheus(stack: tuple) -> None:
    _, _, result = stack
    assert "Prometheus" in result.server.source, result.server.notes
    assert result.server.kv_cache_usage_mean, "KV cache usage per replica from Prometheus"


def _ray_targets_once_up(url: str) -> list[dict[str, str]]:
    """The Prometheus at ``url``'s Ray targets, once all are up (or at the timeout)."""
    deadline = time.monotonic() + DATA_TIMEOUT_S
    targets = [t for t in target_health(url) if t["job"] == RAY_JOB]
    while not all(t["health"] == "up" for t in targets) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        targets = [t for t in target_health(url) if t["job"] == RAY_JOB]
    return targets


def test_the_command_line_scrapes_the_cluster_named_by_ray_address(
    ray_address: str, tmp_path: Path
) -> None:
    """``python -m dashboards.prometheus --ray-address`` as the README gives it: the Ray
    cluster's metrics endpoints are discovered and scraped, and SIGTERM stops it all."""
    command = [
        sys.executable, "-m", "dashboards.prometheus", "--ray-address", ray_address,
        "--port", str(free_port()), "--host", "127.0.0.1", "--router", f"127.0.0.1:{free_port()}",
        "--loadgen", f"127.0.0.1:{free_port()}", "--scrape-interval", "5s",
        "--work-dir", str(tmp_path), "--no-install",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("Ctrl-C stops Prometheus."):
                break
        ray_rows = [row.split() for row in lines if row.strip().startswith(RAY_JOB + " ")]
        assert ray_rows, "\n".join(lines)
        # The table is each target's first scrape: under load one of Ray's endpoints can
        # miss its deadline ("context deadline exceeded"); all must be up soon after. Late
        # in a full run one endpoint missed a 1 s deadline for two minutes (its page holds
        # every replica the session started), so scrapes here get 5 s.
        url = re.search(r"Prometheus: (http://\S+)", lines[0])
        assert url, "\n".join(lines)
        targets = _ray_targets_once_up(url[1])
        assert {t["address"] for t in targets} == {row[1] for row in ray_rows}
        assert all(t["health"] == "up" for t in targets), targets
        prometheus_pids = {c.pid for c in psutil.Process(process.pid).children(recursive=True)}
        assert prometheus_pids, "Prometheus runs as the command's child"
    finally:
        process.terminate()
        returncode = process.wait(30)
    assert returncode == 0, "\n".join(lines)
    assert not [pid for pid in prometheus_pids if psutil.pid_exists(pid)], "Prometheus outlived it"
