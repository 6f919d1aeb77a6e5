"""An auto pool (``deployments/auto.yaml``) on real vLLM engines: every engine runs
the KV connector both ways, and the KV a prompt computed on one engine is loaded by the
other with the same greedy tokens as one engine gives.

The YAML's cost policy decides by load, which a test cannot steer; this module serves
auto.yaml with ``prefill_policy.name: always`` (every prompt prefilled on the engine that
does not decode it), so each engine is producer and consumer many times over: the
``auto`` model of the shapes' shared application (tests/support/shared_apps.py). The cost
policy's decisions are tested without a cluster (tests/router/policies/test_cost_policy.py,
test_auto_pool.py).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from deployments.launcher import RunningApp
from splitserve.metric_catalogue import PREFILL_HEADER, PREFILL_REPLICA_HEADER, REPLICA_HEADER
from tests.support.api_corpus import assert_answers_as
from tests.support.greedy import MODEL, greedy, kv_metric, metric
from tests.support.shared_apps import SHAPES

pytestmark = pytest.mark.serving

AUTO = SHAPES["auto"]
MAX_TOKENS = 8
# The CPU backend's KV block is 128 tokens: less than one, exactly one, several.
_rng = random.Random(11)
PROMPTS = [[_rng.randrange(0, 256) for _ in range(n)] for n in (5, 127, 128, 129, 700, 1500)]
CHAT = "Which engine computed this prompt?"


def _complete(
    base_url: str, prompt: list[int], stream: bool = False, model: str = AUTO.name
) -> tuple[list[int], Any]:
    body = {"prompt": prompt}
    token_ids, _, headers = greedy(base_url, "/v1/completions", body, MAX_TOKENS, stream, model)
    return token_ids, headers


def _chat(base_url: str, stream: bool = False, model: str = AUTO.name) -> list[int]:
    body = {"messages": [{"role": "user", "content": CHAT}]}
    return greedy(base_url, "/v1/chat/completions", body, MAX_TOKENS, stream, model)[0]


def single_reference(base_url: str) -> dict[str, Any]:
    """single.yaml's tokens for this module's prompts (asked by conftest's single_answers)."""
    return {
        "completions": [_complete(base_url, prompt, model=MODEL)[0] for prompt in PROMPTS],
        "chat": _chat(base_url, model=MODEL),
    }


@pytest.fixture(scope="module")
def reference(single_answers: dict[str, Any]) -> dict[str, Any]:
    return single_answers[__name__]


@pytest.fixture(scope="module")
def auto_app(reference: dict, shapes_app: RunningApp) -> RunningApp:
    return shapes_app


def test_each_engine_prefills_for_the_other_with_single_engine_tokens(
    auto_app: RunningApp, reference: dict
) -> None:
    roles: Counter[tuple[str, str]] = Counter()
    for _ in range(2):  # round two: each prompt's blocks are cached where it decoded before
        for prompt, expected in zip(PROMPTS, reference["completions"], strict=True):
            token_ids, headers = _complete(auto_app.base_url, prompt)
            assert token_ids == expected, f"prompt of {len(prompt)} tokens"
            assert headers[PREFILL_HEADER] == "remote:always"
            decode, prefill = headers[REPLICA_HEADER], headers[PREFILL_REPLICA_HEADER]
            assert decode != prefill
            roles[(decode, prefill)] += 1
    # Both engines produced KV and both consumed it.
    first, second = AUTO.engine("mixed", 0), AUTO.engine("mixed", 1)
    assert set(roles) == {(first, second), (second, first)}
    url = auto_app.base_url
    loaded = kv_metric(url, "splitserve_kv_transfers_total", len(PROMPTS), outcome="loaded")
    assert loaded >= len(PROMPTS)
    pushed = kv_metric(url, "splitserve_kv_transfer_loads_total", len(PROMPTS), path="pushed")
    assert pushed >= len(PROMPTS)
    decisions = "splitserve_prefill_decisions_total"
    assert metric(url, decisions, model=AUTO.name, where="remote", reason="always") >= 12


def test_streams_and_chat_match_single_engine(auto_app: RunningApp, reference: dict) -> None:
    for index in (0, 4, 5):
        token_ids, _ = _complete(auto_app.base_url, PROMPTS[index], stream=True)
        assert token_ids == reference["completions"][index]
    assert _chat(auto_app.base_url) == reference["chat"]
    assert _chat(auto_app.base_url, stream=True) == reference["chat"]


def test_every_kind_of_request_is_answered_as_bare_vllm(
    auto_app: RunningApp, vllm_answers: dict[str, Any]
) -> None:
    """An auto pool that always prefills remotely: as one engine answers."""
    assert_answers_as(vllm_answers, auto_app.base_url, AUTO.name)


def test_nothing_is_held_after_clients_leave_mid_stream(auto_app: RunningApp) -> None:
    body = {"model": AUTO.name, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=auto_app.base_url, timeout=120) as http:
        for i in range(20):
            leaves = i % 4 == 0  # 5 of 20 leave right after the first token of 200
            asked = {**body, "prompt": PROMPTS[4 + i % 2], "max_tokens": 200 if leaves else 12}
            with http.stream("POST", "/v1/completions", json=asked) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                if leaves:
                    next(line for line in lines if '"text"' in line)
                    continue
                assert any(line == "data: [DONE]" for line in lines)
    deadline = time.monotonic() + 40  # the YAML's ttl_s and then some
    while time.monotonic() < deadline and any(_holding(auto_app.base_url).values()):
        time.sleep(1)
    assert _holding(auto_app.base_url) == {"live transfers": 0, "unfinished": 0, "kv used": 0}


def _holding(base_url: str) -> dict[str, float]:
    return {
        "live transfers": metric(base_url, "splitserve_kv_transfer_live_transfers"),
        "unfinished": metric(
            base_url, "splitserve_engine_requests", model=AUTO.name, state="unfinished"
        ),
        "kv used": metric(base_url, "splitserve_engine_kv_cache_usage_ratio", model=AUTO.name),
    }
