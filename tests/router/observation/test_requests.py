"""What the router records of each request as it lives (router/observation/requests.py),
read back from its registry."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from router.observation.metrics import RouterMetrics
from router.observation.requests import RequestMetrics
from router.policies.fair_share import Flow
from router.policies.prefill_policy import PrefillDecision


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model": "m", **labels})
    return 0.0 if value is None else value


def _observer() -> tuple[RequestMetrics, CollectorRegistry]:
    metrics = RouterMetrics().for_model("m")
    dispatcher: Any = SimpleNamespace(policy_of=lambda choice, prefill: "round_robin")
    return RequestMetrics(metrics, "pd", dispatcher, None, None), metrics.registry


def test_in_flight_gauges_show_the_engines_state_and_starts_are_counted() -> None:
    observer, registry = _observer()
    state = SimpleNamespace(in_flight=0)
    engines: Any = [SimpleNamespace(name="prefill-0", role="prefill", state=state)]
    for change in (+1, +1, -1):
        state.in_flight += change
        observer.in_flight(engines, started=change > 0)
    labels = {"replica": "prefill-0", "role": "prefill"}
    assert _value(registry, "splitserve_replica_in_flight_requests", **labels) == 1
    assert _value(registry, "splitserve_replica_requests_total", **labels) == 2


def test_the_first_token_is_a_ttft_by_where_it_was_prefilled_and_the_rest_gaps() -> None:
    observer, registry = _observer()
    remote = PrefillDecision("remote", "always")
    team = Flow("team")
    observer.token(arrival=10.0, last_token_at=None, now=10.25, decision=remote, flow=team)
    observer.token(arrival=10.0, last_token_at=10.25, now=10.26, decision=remote, flow=team)
    ttft = {"shape": "pd", "prefill": "remote"}
    assert _value(registry, "splitserve_time_to_first_token_seconds_count", **ttft) == 1
    assert _value(registry, "splitserve_time_to_first_token_seconds_sum", **ttft) == 0.25
    by_key = "splitserve_key_time_to_first_token_seconds"
    assert _value(registry, f"{by_key}_count", key="team") == 1
    assert _value(registry, f"{by_key}_sum", key="team") == 0.25
    gaps = _value(registry, "splitserve_inter_token_latency_seconds_count", shape="pd")
    assert gaps == 1


def test_a_prefix_estimate_is_set_beside_what_vllm_found_unless_the_prompt_moved() -> None:
    observer, registry = _observer()

    def dispatch(reason: str) -> Any:
        return SimpleNamespace(
            decision=PrefillDecision("remote", reason),
            prefill_engine=SimpleNamespace(name="prefill-0"),
            expected_cached_tokens=128,
            plan=SimpleNamespace(cached_by_signal={"kv_events": 128}),
        )

    chunk: Any = SimpleNamespace(num_cached_tokens=0)
    observer.prefix_estimate(dispatch("always"), chunk)
    observer.prefix_estimate(dispatch("prefill_failed"), chunk)  # computed elsewhere
    tokens = "splitserve_prefix_cache_tokens_total"
    assert _value(registry, tokens, replica="prefill-0", source="estimated") == 128
    assert _value(registry, tokens, replica="prefill-0", source="reported") == 0
    errors = "splitserve_prefix_estimate_error_tokens_count"
    assert _value(registry, errors, signal="kv_events") == 1


def test_where_each_prompt_ran_is_counted_once_it_ends() -> None:
    observer, registry = _observer()
    decision = PrefillDecision("remote", "long_prompt").fallen_back("prefill_failed")
    observer.prefill_decided(decision)
    decisions = "splitserve_prefill_decisions_total"
    assert _value(registry, decisions, where="local", reason="prefill_failed") == 1
    assert _value(registry, decisions, where="remote", reason="long_prompt") == 0
