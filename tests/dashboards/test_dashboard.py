"""The Grafana dashboard, provisioning and Prometheus config, checked without a cluster:
structure, datasource references, PromQL syntax (promtool), metric names against the
code that defines them, and every panel on Ray's metrics evaluated by promtool over
synthetic series under each name a Prometheus may store them by.
tests/dashboards/test_prometheus_served.py runs every query for real."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.dashboard import (
    DASHBOARD_PATH,
    ENGINES,
    SERVE,
    TEMPLATE_VARIABLES,
    UTILIZATION,
    build_dashboard,
    expand,
    expressions,
    metric_names,
    render,
)
from dashboards.prometheus import (
    CONFIG_TEMPLATE,
    LOADGEN_JOB,
    PROVISIONING_DIR,
    RAY_JOB,
    ROUTER_JOB,
    ScrapeTargets,
    ensure_prometheus,
    render_config,
)
from tests.dashboards.names import (
    SAMPLER_KINDS,
    VLLM_KINDS,
    code_names,
    ray_exported_names,
    ray_name,
    serve_names,
)

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD_PATH.read_text())


def test_committed_dashboard_is_the_generated_one() -> None:
    assert DASHBOARD_PATH.read_text() == render(), "run: python -m dashboards.dashboard"


def test_panel_ids_unique_and_layout_inside_the_grid(dashboard: dict) -> None:
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(positions) == len(set(positions)), "two panels on the same spot"


def test_rows_cover_the_issue(dashboard: dict) -> None:
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    for word in ("Client", "Router", "Engines", "Serve", "KV transfer", "QoS", "Utilization"):
        assert any(word in row for row in rows), word
    titles = [p["title"] for p in dashboard["panels"]]
    assert any("imbalance" in title for title in titles)


def test_every_datasource_reference_is_the_variable(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE_REF, panel["title"]
    for name in TEMPLATE_VARIABLES:
        assert variables[name]["datasource"] == DATASOURCE_REF
        assert variables[name]["allValue"] == ".*"


def test_variables_used_in_queries_are_defined(dashboard: dict) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    for title, expr in expressions(dashboard):
        for word in expr.split("$")[1:]:
            name = word.split('"')[0].split("]")[0]
            assert name in defined or name.startswith("__"), f"{title}: ${name}"


def test_promql_parses_with_promtool(dashboard: dict, tmp_path: Path) -> None:
    # promtool validates recording rules' expressions: one rule per dashboard query.
    _, promtool = ensure_prometheus()
    rules = [
        {"record": f"splitserve:dashboard_query_{index}", "expr": expand(expr, "1m")}
        for index, (_, expr) in enumerate(expressions(dashboard))
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_metric_named_is_defined_in_code(dashboard: dict) -> None:
    known = code_names()
    missing = {
        (title, name)
        for title, expr in expressions(dashboard)
        for name in metric_names(expr)
        if name not in known
    }
    assert not missing, sorted(missing)


def test_vllm_names_exist_in_vllm() -> None:
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    for name in VLLM_KINDS:
        assert f'"{name}"' in source, name


def test_serve_names_exist_in_ray() -> None:
    """The Serve row's names are Ray Serve's families as Ray exports them (counters _total)."""
    read = {name for _, expr in expressions(build_dashboard()) for name in metric_names(expr)}
    serve = {name for name in read if name.startswith("ray_serve_")}
    assert serve >= {
        "ray_serve_deployment_replica_healthy",
        "ray_serve_autoscaling_target_replicas",
        "ray_serve_num_deployment_http_error_requests_total",
        "ray_serve_deployment_error_counter_total",
    }
    assert serve <= serve_names()


def test_prometheus_config_is_valid_and_renders_targets(tmp_path: Path) -> None:
    _, promtool = ensure_prometheus()
    result = subprocess.run(
        [promtool, "check", "config", str(CONFIG_TEMPLATE)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    config = render_config(
        ScrapeTargets("10.0.0.1:8000", Path("/r/sd.json"), "10.0.0.2:9400", "1s", "5s")
    )
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs[ROUTER_JOB]["static_configs"] == [{"targets": ["10.0.0.1:8000"]}]
    assert jobs[LOADGEN_JOB]["static_configs"] == [{"targets": ["10.0.0.2:9400"]}]
    assert jobs[RAY_JOB]["file_sd_configs"] == [{"files": ["/r/sd.json"]}]
    assert config["global"]["scrape_interval"] == "1s"
    assert jobs[RAY_JOB]["scrape_interval"] == jobs[RAY_JOB]["scrape_timeout"] == "5s"
    assert "scrape_interval" not in jobs[ROUTER_JOB]
    # Ray's names are mapped back: ray_vllm_x -> vllm:x, ray_splitserve_x -> splitserve_x
    replacements = {r.get("replacement") for r in jobs[RAY_JOB]["metric_relabel_configs"]}
    assert {"vllm:$1", "$1"} <= replacements
    # The alert rules beside the template, by a path that holds wherever the config is written.
    [rules] = config["rule_files"]
    assert Path(rules) == CONFIG_TEMPLATE.parent / "alerts.yml" and Path(rules).is_file()


def test_grafana_provisioning_points_at_the_dashboard_and_datasource() -> None:
    datasource = yaml.safe_load((PROVISIONING_DIR / "datasources" / "splitserve.yml").read_text())
    [source] = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${SPLITSERVE_PROMETHEUS_URL}"
    provider = yaml.safe_load((PROVISIONING_DIR / "dashboards" / "splitserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "${SPLITSERVE_DASHBOARDS_DIR}"
    assert DASHBOARD_PATH.parent.name == "dashboards"
    assert build_dashboard()["uid"] == "splitserve"


# Panels on Ray's metrics, evaluated by promtool over synthetic series. A Prometheus
# holds them under Ray's names (scraping Ray's endpoint as it is), under the names
# dashboards/prometheus.yml renames them to, or under both (two scrape jobs, one with
# the rules): every such panel must have data in each case, without errors.
STEP, STEPS, EVAL_AT = "15s", 40, "10m"
ENGINE_LABELS = (
    'replica="prefill-0", role="prefill"',
    'replica="decode-0", role="decode"',
)
# Labels Ray and vLLM put on every series, which the panels must aggregate away.
RAY_LABELS = 'model_name="m", engine="0", ReplicaId="r1", SessionName="s1", job="ray"'
DEVICE_FAMILIES = ("splitserve_gpu_", "splitserve_cpu_")  # the sampler's, per device
SERVE_LABELS = 'application="splitserve", deployment="decode-pool"'
SERVE_SERIES = (
    (f'ray_serve_deployment_replica_healthy{{{SERVE_LABELS}, replica="d1"}}', f"1x{STEPS}"),
    (f"ray_serve_autoscaling_target_replicas{{{SERVE_LABELS}}}", f"2x{STEPS}"),
)
# Ray creates an error counter's series at the first error: with and without them.
SERVE_ERROR_SERIES = (
    (
        f'ray_serve_num_deployment_http_error_requests_total{{{SERVE_LABELS}, error_code="500",'
        ' method="POST", route="/"}',
        f"0+1x{STEPS}",
    ),
    (
        f'ray_serve_deployment_error_counter_total{{{SERVE_LABELS}, replica="d1", route="/",'
        ' exception_type="RuntimeError"}',
        f"0+1x{STEPS}",
    ),
)


def _relabel(name: str) -> str:
    """``name`` after the Ray job's renaming rules in dashboards/prometheus.yml."""
    config = yaml.safe_load(CONFIG_TEMPLATE.read_text())
    [job] = [job for job in config["scrape_configs"] if job["job_name"] == RAY_JOB]
    for rule in job["metric_relabel_configs"]:
        if rule.get("target_label") != "__name__":
            continue
        found = re.fullmatch(rule["regex"], name)  # Prometheus anchors its regexes
        if found:
            name = found.expand(rule["replacement"].replace("$1", r"\1"))
    return name


def _family_series(name: str, kind: str, labels: str) -> list[tuple[str, str]]:
    """One family's series: a gauge holds 3, a counter counts 5 a step, buckets fill."""
    if kind == "gauge":
        return [(f"{name}{{{labels}}}", f"3x{STEPS}")]
    if kind == "counter":
        return [(f"{name}_total{{{labels}}}", f"0+5x{STEPS}")]
    buckets = (("0.1", 1), ("1.0", 2), ("+Inf", 3))
    return [
        *((f'{name}_bucket{{{labels}, le="{le}"}}', f"0+{n}x{STEPS}") for le, n in buckets),
        (f"{name}_sum{{{labels}}}", f"0+2x{STEPS}"),
        (f"{name}_count{{{labels}}}", f"0+3x{STEPS}"),
    ]


def _family_labels(family: str, device: str) -> str:
    """The labels a family has beside the engine's and Ray's."""
    if family == "vllm:prompt_tokens_by_source":
        return 'source="local_compute"'
    if family == "splitserve_utilization_samples":
        return 'source="nvml"' if device == "gpu" else 'source="cpu"'
    if family.startswith("splitserve_gpu_"):
        return 'gpu="0"'
    return 'process="EngineCore"' if family.startswith("splitserve_cpu_") else ""


def _engine_series(names: str, device: str) -> list[tuple[str, str]]:
    """vLLM's and the sampler's series of every engine, under Ray's names, the renamed
    ones (prometheus.yml applied to Ray's) or both; the sampler's of ``device`` only
    (GPU where NVML answers, else CPU)."""
    series = []
    for family, kind in (VLLM_KINDS | SAMPLER_KINDS).items():
        if family.startswith(DEVICE_FAMILIES) and not family.startswith(f"splitserve_{device}_"):
            continue
        as_ray = ray_name(family)
        renamed = _relabel(as_ray)
        named = {"ray": [as_ray], "renamed": [renamed], "both": [as_ray, renamed]}[names]
        labels = ", ".join(filter(None, (RAY_LABELS, _family_labels(family, device))))
        for name in named:
            for engine in ENGINE_LABELS:
                series += _family_series(name, kind, f"{engine}, {labels}")
    return series


def _reads_ray_endpoint(expr: str) -> bool:
    return bool(metric_names(expr) & (ray_exported_names() | serve_names()))


def _promtool_has_data(
    series: list[tuple[str, str]], exprs: list[str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """promtool test rules: each expression has a finite sample at EVAL_AT."""
    tests = [
        {
            # NaN fails `>= -Inf`: a panel showing only NaN has no data either.
            "expr": f"clamp_max(count(({expand(expr, '1m')}) >= -Inf), 1)",
            "eval_time": EVAL_AT,
            "exp_samples": [{"labels": "{}", "value": 1}],
        }
        for expr in exprs
    ]
    suite: dict[str, Any] = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": STEP,
                "input_series": [{"series": s, "values": v} for s, v in series],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "panels_test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False, width=1000))
    _, promtool = ensure_prometheus()
    return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True)


def test_renaming_rules_invert_rays_names() -> None:
    for family in VLLM_KINDS | SAMPLER_KINDS:
        assert _relabel(ray_name(family)) == family


@pytest.mark.parametrize(
    ("names", "device", "serve_errors"),
    [
        ("ray", "gpu", False),
        ("ray", "cpu", True),
        ("renamed", "cpu", False),
        ("renamed", "gpu", True),
        ("both", "cpu", True),
    ],
)
def test_every_panel_on_rays_metrics_has_data(
    dashboard: dict, names: str, device: str, serve_errors: bool, tmp_path: Path
) -> None:
    read = [(title, expr) for title, expr in expressions(dashboard) if _reads_ray_endpoint(expr)]
    rows = (ENGINES, SERVE, UTILIZATION)
    assert {title for title, _ in read} == {panel.title for row in rows for panel in row.panels}
    exprs = [expr for _, expr in read]
    series = _engine_series(names, device) + list(SERVE_SERIES)
    series += list(SERVE_ERROR_SERIES) if serve_errors else []
    result = _promtool_has_data(series, exprs, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
