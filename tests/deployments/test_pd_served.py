"""PD as ``deployments/pd_always.yaml`` serves it (every prompt prefilled remotely, the
study's PD), a model of the shapes' shared application: same tokens as one engine,
nothing leaked.

The reference tokens come from ``single.yaml`` on the same prompts; the KV really moved
(the transfer counters say so), and after clients leave mid-stream neither the object
store nor the engines hold anything.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.launcher import RunningApp, replica_engine_pids
from tests.support.api_corpus import assert_answers_as
from tests.support.greedy import MODEL, greedy, kv_metric, metric
from tests.support.served_apps import ServedApps
from tests.support.shared_apps import SHAPES, shared_app

pytestmark = pytest.mark.serving

PD = SHAPES["pd_always"]
PREFILL, DECODE = PD.engine("prefill", 0), PD.engine("decode", 0)
MAX_TOKENS = 10
# The CPU backend's KV block is 128 tokens: one block, its neighbours, many blocks.
LENGTHS = [1, 2, 17, 127, 128, 129, 256, 300, 511, 700, 1000, 1500]
_rng = random.Random(7)
LENGTHS += [_rng.randint(1, 1500) for _ in range(7)]
PROMPTS = [[_rng.randrange(0, 256) for _ in range(n)] for n in LENGTHS]
PROMPTS.append(list(PROMPTS[9]))  # repeats one the decode replica has cached by then
CHATS = ["Tell me about disaggregated serving.", "Short?"]
KV_PAGE_BYTES = 128 * 2 * 2 * 2 * 32 * 4  # block x K,V x layers x kv heads x head dim x fp32


def _complete(
    base_url: str, prompt: list[int], stream: bool = False, model: str = PD.name
) -> tuple[list[int], dict]:
    body = {"prompt": prompt}
    return greedy(base_url, "/v1/completions", body, MAX_TOKENS, stream, model)[:2]


def _chat(
    base_url: str, content: str, stream: bool = False, model: str = PD.name
) -> tuple[list[int], dict]:
    messages = [{"role": "user", "content": content}]
    body = {"messages": messages}
    return greedy(base_url, "/v1/chat/completions", body, MAX_TOKENS, stream, model)[:2]


def single_reference(base_url: str) -> dict[str, Any]:
    """single.yaml's tokens for this module's prompts (asked by conftest's single_answers)."""
    return {
        "completions": [_complete(base_url, p, model=MODEL)[0] for p in PROMPTS],
        "chats": [_chat(base_url, c, model=MODEL)[0] for c in CHATS],
    }


@pytest.fixture(scope="module")
def reference(single_answers: dict[str, Any]) -> dict[str, Any]:
    return single_answers[__name__]


@pytest.fixture(scope="module")
def pd_app(reference: dict, served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    # test_requests_complete_when_the_prefill_engine_dies kills an engine.
    return served_apps.get(str(shared_app(serve_logs, "shapes", SHAPES)), restarts_expected=True)


def test_completions_match_single_engine(pd_app: RunningApp, reference: dict) -> None:
    for prompt, expected in zip(PROMPTS, reference["completions"], strict=True):
        token_ids, usage = _complete(pd_app.base_url, prompt)
        assert token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == MAX_TOKENS
    # The KV moved rather than being recomputed on the decode side.
    transfers = "splitserve_kv_transfers_total"
    assert kv_metric(pd_app.base_url, transfers, 15, outcome="loaded") >= 15
    decisions = "splitserve_prefill_decisions_total"
    assert metric(pd_app.base_url, decisions, model=PD.name, where="remote") >= 20
    # Pushed to the decode engine the router named, not claimed when the load was due.
    loads = "splitserve_kv_transfer_loads_total"
    assert kv_metric(pd_app.base_url, loads, 15, path="pushed") >= 15
    assert metric(pd_app.base_url, loads, path="claimed") <= 1


def test_streams_match_single_engine(pd_app: RunningApp, reference: dict) -> None:
    for index in (0, 4, 9, 11):
        token_ids, usage = _complete(pd_app.base_url, PROMPTS[index], stream=True)
        assert token_ids == reference["completions"][index]
        assert usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] == len(PROMPTS[index])


def test_chat_matches_single_engine(pd_app: RunningApp, reference: dict) -> None:
    for content, expected in zip(CHATS, reference["chats"], strict=True):
        assert _chat(pd_app.base_url, content)[0] == expected
        assert _chat(pd_app.base_url, content, stream=True)[0] == expected


def test_every_kind_of_request_is_answered_as_bare_vllm(
    pd_app: RunningApp, vllm_answers: dict[str, Any]
) -> None:
    """Through remote prefills: grammars, seeds and penalties continue on the decode engine."""
    assert_answers_as(vllm_answers, pd_app.base_url, PD.name)


def test_nothing_left_after_clients_leave_mid_stream(pd_app: RunningApp, ray_address: str) -> None:
    body = {"model": PD.name, "ignore_eos": True, "stream": True}
    # Serve keeps objects of its own (configs, handles); only new ones would be ours.
    baseline = {obj.object_id for obj in _large_objects(ray_address)}
    with httpx.Client(base_url=pd_app.base_url, timeout=120) as http:
        for i in range(50):
            leaves = i % 5 == 0  # 10 of 50 leave right after the first token of 200
            asked = {
                **body,
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": 200 if leaves else 20,
            }
            with http.stream("POST", "/v1/completions", json=asked) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                if leaves:
                    next(line for line in lines if '"token' in line or '"text"' in line)
                    continue
                assert any(line == "data: [DONE]" for line in lines)
    ttl_s = 30
    deadline = time.monotonic() + ttl_s + 10
    while time.monotonic() < deadline and any(_holding(pd_app.base_url).values()):
        time.sleep(1)
    # A prefill engine keeps a request's blocks until its put is reported done: blocks
    # still in use would be requests whose put vLLM never heard the end of.
    assert _holding(pd_app.base_url) == {"live transfers": 0, "unfinished": 0, "kv used": 0}
    leaked = [obj for obj in _large_objects(ray_address) if obj.object_id not in baseline]
    assert not leaked, f"objects left in Ray's object store: {leaked}"


def _holding(base_url: str) -> dict[str, float]:
    return {
        "live transfers": metric(base_url, "splitserve_kv_transfer_live_transfers"),
        "unfinished": metric(
            base_url, "splitserve_engine_requests", model=PD.name, state="unfinished"
        ),
        "kv used": metric(base_url, "splitserve_engine_kv_cache_usage_ratio", model=PD.name),
    }


def _large_objects(ray_address: str) -> list[Any]:
    from ray.util.state import list_objects

    objects = list_objects(
        address=ray_address, limit=10_000, raise_on_missing_output=False, timeout=30
    )
    return [obj for obj in objects if (obj.object_size or 0) >= KV_PAGE_BYTES]


def test_requests_complete_when_the_prefill_engine_dies(pd_app: RunningApp) -> None:
    results: list[int] = []

    def one(prompt: list[int]) -> None:
        token_ids, _ = _complete(pd_app.base_url, prompt, stream=True)
        results.append(len(token_ids))

    threads = [threading.Thread(target=one, args=(PROMPTS[i % 12],)) for i in range(16)]
    decode_pids = replica_engine_pids(DECODE)
    dead = replica_engine_pids(PREFILL)
    for thread in threads[:8]:
        thread.start()
    _kill_engine(PREFILL)
    for thread in threads[8:]:
        thread.start()
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=180)
    assert results == [MAX_TOKENS] * 16
    decisions = "splitserve_prefill_decisions_total"
    assert metric(pd_app.base_url, decisions, model=PD.name, where="local") >= 1
    # The router replaced the prefill engine alone: the decode engine never stopped.
    deadline = time.monotonic() + 180
    while not (replica_engine_pids(PREFILL) - dead):
        assert time.monotonic() < deadline, "no new prefill engine"
        time.sleep(1)
    assert replica_engine_pids(DECODE) == decode_pids
    _wait_healthy(pd_app.base_url)


def _wait_healthy(base_url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the application did not become healthy again"
        time.sleep(1)


def _kill_engine(name: str) -> None:
    """Kill one engine's processes; the router hosts it, and must restart it alone."""
    pids = replica_engine_pids(name)
    if not pids:
        pytest.fail(f"no engine process for {name}")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
