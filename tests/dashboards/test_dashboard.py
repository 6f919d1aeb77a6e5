"""The Grafana dashboard, provisioning and Prometheus config, checked without a cluster:
structure, datasource references, PromQL syntax (promtool) and metric names against
the code that defines them. tests/dashboards/test_prometheus_served.py runs every query for real."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from dashboards.dashboard import (
    DASHBOARD_PATH,
    TEMPLATE_VARIABLES,
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
from kv_transfer.metrics import KVTransferCollector, TransferStats
from loadgen.exposition import Exposition

DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
SAMPLER_NAMES = {
    f"splitserve_{kind}_{suffix}"
    for kind in ("gpu", "cpu")
    for suffix in ("utilization_percent", "memory_used_bytes", "busy_seconds_total")
} | {"splitserve_utilization_samples_total"}
# vLLM's names the engine panels read (vllm/v1/metrics/loggers.py), as Prometheus stores
# them after dashboards/prometheus.yml renames Ray's ray_vllm_x back to vllm:x.
VLLM_BASE_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:request_time_per_output_token_seconds",
)


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
    for word in ("Client", "Router", "Engines", "KV transfer", "QoS", "Utilization"):
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


def _exposed_names(registry: CollectorRegistry) -> set[str]:
    names = set()
    for family in registry.collect():
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
        }.get(family.type, ("",))
        names |= {family.name + suffix for suffix in suffixes}
    return names


def _code_names() -> set[str]:
    from router.observation.metrics import RouterMetrics

    names = _exposed_names(RouterMetrics().registry) | _exposed_names(Exposition().registry)
    kv = CollectorRegistry()
    kv.register(KVTransferCollector(lambda: TransferStats().snapshot(0, 0)))
    names |= _exposed_names(kv)
    names |= SAMPLER_NAMES
    for base in VLLM_BASE_NAMES:
        names |= {base, f"{base}_total", f"{base}_bucket"}
    return names


def test_every_metric_named_is_defined_in_code(dashboard: dict) -> None:
    known = _code_names()
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
    for name in VLLM_BASE_NAMES:
        assert f'"{name}"' in source, name


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


def test_grafana_provisioning_points_at_the_dashboard_and_datasource() -> None:
    datasource = yaml.safe_load((PROVISIONING_DIR / "datasources" / "splitserve.yml").read_text())
    [source] = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${SPLITSERVE_PROMETHEUS_URL}"
    provider = yaml.safe_load((PROVISIONING_DIR / "dashboards" / "splitserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "${SPLITSERVE_DASHBOARDS_DIR}"
    assert DASHBOARD_PATH.parent.name == "dashboards"
    assert build_dashboard()["uid"] == "splitserve"
