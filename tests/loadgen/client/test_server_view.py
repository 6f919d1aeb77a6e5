"""The server's view of a run from its /metrics text: deltas, utilization, absent metrics."""

from __future__ import annotations

import httpx
import pytest

from loadgen.client.server_view import ServerViewRecorder, build_view, discover_shape, parse_metrics

BEFORE = """
# TYPE splitserve_requests_total counter
splitserve_requests_total{route="/v1/completions",status="200"} 10
splitserve_requests_total{route="/v1/completions",status="503"} 1
# TYPE splitserve_prefill_decisions_total counter
splitserve_prefill_decisions_total{where="local",reason="short"} 4
splitserve_prefill_decisions_total{where="remote",reason="long"} 6
# TYPE splitserve_rejections_total counter
splitserve_rejections_total{reason="slo"} 1
# TYPE splitserve_gpu_utilization_percent gauge
splitserve_gpu_utilization_percent{gpu="0"} 0
splitserve_gpu_utilization_percent{gpu="1"} 0
"""


def _during(gpu0: float, gpu1: float, kv: float, waiting: int) -> str:
    return f"""
# TYPE splitserve_gpu_utilization_percent gauge
splitserve_gpu_utilization_percent{{gpu="0"}} {gpu0}
splitserve_gpu_utilization_percent{{gpu="1"}} {gpu1}
# TYPE splitserve_cpu_utilization_percent gauge
splitserve_cpu_utilization_percent 50
# TYPE splitserve_engine_kv_cache_usage_ratio gauge
splitserve_engine_kv_cache_usage_ratio{{replica="engine-0",role="mixed"}} {kv}
# TYPE splitserve_engine_requests gauge
splitserve_engine_requests{{replica="engine-0",role="mixed",state="waiting"}} {waiting}
splitserve_engine_requests{{replica="engine-0",role="mixed",state="running"}} 2
"""


AFTER = (
    BEFORE.replace("} 10", "} 30")
    .replace('status="503"} 1', 'status="503"} 4')
    .replace('reason="short"} 4', 'reason="short"} 9')
    .replace('reason="long"} 6', 'reason="long"} 21')
    .replace('reason="slo"} 1', 'reason="slo"} 4')
    .replace('gpu="0"} 0', 'gpu="0"} 100')
    .replace('gpu="1"} 0', 'gpu="1"} 10')
)


def test_counters_are_deltas_and_gauges_means() -> None:
    during = [parse_metrics(_during(90, 10, 0.2, 1)), parse_metrics(_during(98, 4, 0.6, 5))]
    view = build_view(parse_metrics(BEFORE), during, parse_metrics(AFTER))
    assert view.requests_by_status == {"200": 20, "503": 3}
    assert (view.prefill_local, view.prefill_remote, view.rejections) == (5, 15, 3)
    assert view.gpu_utilization_pct == pytest.approx({"0": 96.0, "1": 8.0})  # (90+98+100)/3 ...
    assert view.gpu_utilization_mean_pct == pytest.approx(52.0)
    assert view.gpu_imbalance_pct == pytest.approx(88.0)  # max - min, as the study reports
    assert view.kv_cache_usage_mean == pytest.approx({"engine-0": 0.4})
    assert view.kv_cache_usage_max == {"engine-0": 0.6}
    assert (view.engine_waiting_max, view.engine_running_max) == (5, 2)
    assert view.other_utilization_pct == {"splitserve_cpu_utilization_percent": {"value": 50.0}}


def test_absent_metrics_are_left_out() -> None:
    text = (
        "# TYPE splitserve_requests_total counter\n"
        'splitserve_requests_total{route="/x",status="200"} 3\n'
    )
    view = build_view(None, [], parse_metrics(text))
    assert view.gpu_utilization_mean_pct is None and view.gpu_imbalance_pct is None
    assert view.prefill_local is None and view.rejections is None
    assert view.requests_by_status == {"200": 3}
    unreachable = build_view(None, [], None)
    assert unreachable.source == "none" and "could not be scraped" in unreachable.notes[0]


def test_counter_reset_counts_from_zero() -> None:
    restarted = BEFORE.replace('reason="slo"} 1', 'reason="slo"} 0.5').replace("} 10", "} 2")
    view = build_view(parse_metrics(AFTER), [], parse_metrics(restarted))
    assert view.rejections == 0.5 and view.requests_by_status["200"] == 2


def test_mode_comes_from_the_router_histograms() -> None:
    text = (
        "# TYPE splitserve_time_to_first_token_seconds histogram\n"
        'splitserve_time_to_first_token_seconds_count{shape="dp",prefill="local"} 4\n'
    )
    assert discover_shape(parse_metrics(text)) == "dp"
    assert discover_shape(parse_metrics(BEFORE)) is None


def test_a_router_of_several_models_is_in_the_shape_of_the_model_a_run_loads() -> None:
    text = "# TYPE splitserve_time_to_first_token_seconds histogram\n" + "".join(
        f'splitserve_time_to_first_token_seconds_count{{model="{model}",shape="{shape}"'
        f',prefill="local"}} 4\n'
        for model, shape in (("a", "dp"), ("b", "pd"), ("b2", "pd"), ("c", "single"))
    )
    assert discover_shape(parse_metrics(text), "c") == "single"
    assert discover_shape(parse_metrics(text), "adapter-of-c") == "pd"  # no series: any


async def test_prometheus_figures_replace_the_router_samples() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_during(10, 10, 0.1, 0))
        query = request.url.params["query"]
        assert request.url.path == "/api/v1/query"
        if "gpu_utilization" in query:
            result = [
                {"metric": {"gpu": "0"}, "value": [0, "70"]},
                {"metric": {"gpu": "1"}, "value": [0, "30"]},
            ]
        else:
            result = [{"metric": {"replica": "engine-0"}, "value": [0, "0.5"]}]
        return httpx.Response(200, json={"status": "success", "data": {"result": result}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        recorder = ServerViewRecorder(
            http, "http://router/metrics", 10.0, prometheus_url="http://prometheus:9090"
        )
        await recorder.start()
        await recorder.stop()
        view = await recorder.view()
    assert "Prometheus" in view.source
    assert view.gpu_utilization_pct == {"0": 70.0, "1": 30.0}
    assert view.gpu_imbalance_pct == 40.0
    assert view.kv_cache_usage_max == {"engine-0": 0.5}
