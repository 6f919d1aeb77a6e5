"""dashboards/alerts.yml: valid (promtool check rules), each rule fires where it should
and stays quiet where it should not (promtool test rules over tests/dashboards/alerts_test.yml),
and every name and SLO bound it reads exists in the code that records it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.utils import floatToGoString

from dashboards.dashboard import metric_names
from dashboards.prometheus import CONFIG_TEMPLATE, ensure_prometheus
from splitserve.metric_catalogue import ITL_BUCKETS_S, LATENCY_BUCKETS_S
from tests.dashboards.names import code_names

ALERTS_PATH = CONFIG_TEMPLATE.parent / "alerts.yml"
ALERTS_TEST_PATH = Path(__file__).with_name("alerts_test.yml")
# The router's histograms an SLO bound may be read from, and their bucket bounds.
SLO_HISTOGRAMS = {
    "splitserve_time_to_first_token_seconds_bucket": LATENCY_BUCKETS_S,
    "splitserve_inter_token_latency_seconds_bucket": ITL_BUCKETS_S,
}
BUCKET_SELECTOR = re.compile(r'(\w+_bucket)\{[^}]*\ble="([^"]*)"')


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS_PATH.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    _, promtool = ensure_prometheus()
    return subprocess.run([promtool, *args], capture_output=True, text=True)


def test_alert_rules_are_valid() -> None:
    result = _promtool("check", "rules", str(ALERTS_PATH))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_prometheus_config_loads_the_alert_rules() -> None:
    assert yaml.safe_load(CONFIG_TEMPLATE.read_text())["rule_files"] == [ALERTS_PATH.name]
    result = _promtool("check", "config", str(CONFIG_TEMPLATE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    result = _promtool("test", "rules", str(ALERTS_TEST_PATH))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_seen_firing_by_a_unit_test() -> None:
    tests = yaml.safe_load(ALERTS_TEST_PATH.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case["exp_alerts"]
    }
    assert fired == {rule["alert"] for rule in _rules()}


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule["alert"])
def test_alert_reads_only_names_the_code_exports(rule: dict[str, Any]) -> None:
    assert metric_names(rule["expr"]) <= code_names()


def test_slo_bounds_are_bucket_bounds_of_the_router_histograms() -> None:
    """A bound between buckets would match no series and the alert would never fire."""
    bounds = [found for rule in _rules() for found in BUCKET_SELECTOR.findall(rule["expr"])]
    assert {histogram for histogram, _ in bounds} == set(SLO_HISTOGRAMS)
    for histogram, le in bounds:
        assert le in {floatToGoString(bound) for bound in SLO_HISTOGRAMS[histogram]}, (
            f"{histogram}: le={le!r} is not one of its buckets as prometheus-client writes them"
        )
