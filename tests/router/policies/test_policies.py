"""The router's decisions as pure functions: where PD prefills, replica choice, prefix
mirror, QoS."""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import NoReturn

import pytest

from engines.protocol import EngineStats
from router.http.errors import Rejection
from router.http.requests import take_priority
from router.policies.engine_choices import (
    LeastLoaded,
    PrefixAffinity,
    PrefixAffinitySettings,
    RoundRobin,
)
from router.policies.prefill_policies import ConditionalSettings, should_prefill_remotely
from router.policies.prefill_policy import PrefillDecision, PrefillInputs, make_prefill_policy
from router.policies.qos import AdmissionControl, Refusal
from router.pool.engine_state import EngineState
from router.pool.pooled_engine import PooledEngine
from router.pool.prefix_index import PrefixIndex, PromptBlocks
from router.settings import Priority, QoSConfig

# The chapter's tunables: 256-token threshold, queue of 10, 8 active decodes, 64 tokens.
CHAPTER = ConditionalSettings(
    prompt_length_threshold=256,
    prefill_queue_max=10,
    decode_load_threshold=8,
    decode_busy_min_length=64,
)
QOS = QoSConfig(low_priority_remote_max_queue=2)


def _where_why(decision: PrefillDecision) -> tuple[str, str]:
    return decision.where, decision.reason


@pytest.mark.parametrize(
    ("prompt", "cached", "queue", "decode", "priority", "expected"),
    [
        # The chapter's cases.
        (1000, 0, 0, 0, "normal", ("remote", "long_prompt")),
        (5, 0, 0, 0, "normal", ("local", "short_prompt")),
        (1000, 900, 0, 0, "normal", ("local", "prefix_cached")),
        (1000, 0, 10, 0, "normal", ("local", "prefill_queue_full")),
        (100, 0, 0, 8, "normal", ("remote", "decode_busy")),
        (63, 0, 0, 8, "normal", ("local", "short_prompt")),
        # Thresholds are inclusive where the chapter's code is (>=).
        (256, 0, 9, 0, "normal", ("remote", "long_prompt")),
        (255, 0, 9, 7, "normal", ("local", "short_prompt")),
        (300, 44, 0, 0, "normal", ("remote", "long_prompt")),
        (300, 45, 0, 0, "normal", ("local", "prefix_cached")),
        # A busy decode replica does not push work into a full prefill pool.
        (100, 0, 10, 8, "normal", ("local", "short_prompt")),
        # Priorities.
        (1000, 0, 10, 0, "high", ("remote", "high_priority")),
        (1000, 0, 1, 0, "low", ("remote", "long_prompt")),
        (1000, 0, 2, 0, "low", ("local", "low_priority")),
        (100, 0, 2, 8, "low", ("local", "low_priority")),
    ],
)
def test_conditional_split(
    prompt: int, cached: int, queue: int, decode: int, priority: str, expected: tuple[str, str]
) -> None:
    inputs = PrefillInputs(prompt, cached, queue, decode, priority)  # type: ignore[arg-type]
    assert _where_why(should_prefill_remotely(inputs, CHAPTER, QOS)) == expected


@pytest.mark.parametrize(("mode", "expected"), [("always", "remote"), ("never", "local")])
def test_fixed_modes_ignore_everything_else(mode: str, expected: str) -> None:
    policy = make_prefill_policy(mode, CHAPTER, QOS)
    for prompt, queue, priority in [(5, 0, "normal"), (4000, 50, "low"), (4000, 50, "high")]:
        decision = policy.decide(PrefillInputs(prompt, 0, queue, 20, priority))  # type: ignore[arg-type]
        assert _where_why(decision) == (expected, mode)


# ---- prefix mirror ---------------------------------------------------------------------


def test_prefix_index_counts_leading_full_blocks() -> None:
    index = PrefixIndex(block_size=4, capacity_blocks=100)
    index.record(PromptBlocks(list(range(10))))  # blocks [0..3], [4..7]; 8, 9 not full
    assert index.cached_tokens(PromptBlocks(list(range(12)))) == 8
    assert index.cached_tokens(PromptBlocks([*range(6), 99, 99, 99])) == 4
    assert index.cached_tokens(PromptBlocks([99, *range(1, 12)])) == 0
    # The same tokens at another position hash differently: blocks chain on their parent.
    assert index.cached_tokens(PromptBlocks([*range(4, 8), *range(4, 8), 0])) == 0


def test_prefix_index_leaves_the_last_token_to_compute() -> None:
    index = PrefixIndex(block_size=4, capacity_blocks=100)
    index.record(PromptBlocks(list(range(8))))
    # vLLM recomputes the last token of a fully cached prompt to get its logits.
    assert index.cached_tokens(PromptBlocks(list(range(8)))) == 4
    assert index.cached_tokens(PromptBlocks(list(range(9)))) == 8


def test_prefix_index_forgets_least_recently_used_beyond_capacity() -> None:
    index = PrefixIndex(block_size=2, capacity_blocks=4)
    first, second = PromptBlocks([1, 2, 3, 4, 0]), PromptBlocks([5, 6, 7, 8, 0])
    index.record(first)
    index.record(second)
    index.record(first)  # first is now the most recent
    index.record(PromptBlocks([9, 10, 11, 12, 0]))
    assert len(index) == 4
    assert index.cached_tokens(first) == 4
    assert index.cached_tokens(second) == 0


# ---- replica choice --------------------------------------------------------------------


def _replica(name: str, active: int = 0, kv: float = 0.0) -> PooledEngine:
    state = EngineState()
    state.update_engine(
        EngineStats(
            replica=name,
            role="mixed",
            num_running=active,
            kv_cache_usage=kv,
            block_size=4,
            kv_capacity_blocks=1000,
        )
    )
    return PooledEngine(
        name,
        "mixed",
        link=None,  # type: ignore[arg-type]  # the policies read its state, never the engine
        submit_timeout_s=1.0,
        state=state,
    )


PROMPT = PromptBlocks(list(range(40)))


def test_round_robin_takes_turns_whatever_the_load() -> None:
    replicas = [_replica("a", active=9), _replica("b")]
    choice = RoundRobin()
    chosen = [choice.choose(replicas, PROMPT).engine.name for _ in range(4)]
    assert chosen == ["a", "b", "a", "b"]


def test_least_loaded_prefers_fewer_requests_then_emptier_cache() -> None:
    busy, idle_full, idle_empty = _replica("busy", 3), _replica("f", 0, 0.9), _replica("e", 0, 0.1)
    assert LeastLoaded().choose([busy, idle_full, idle_empty], PROMPT).engine is idle_empty
    busy.state.in_flight = 0
    busy.state.update_engine(EngineStats(replica="busy", role="mixed", num_waiting=0))
    # The router's own in-flight count counts even before the engine reports it.
    idle_empty.state.in_flight = 5
    assert LeastLoaded().choose([idle_full, idle_empty], PROMPT).engine is idle_full


def test_a_prefill_replica_is_as_loaded_as_its_prefill_queue() -> None:
    decoding, queued = _replica("decoding"), _replica("queued")
    for replica in (decoding, queued):
        replica.role = "prefill"
    decoding.state.in_flight = 6  # requests whose decode runs elsewhere by now
    queued.state.enqueue_prefill(500, now=0.0)
    assert LeastLoaded().choose([queued, decoding], PROMPT).engine is decoding


def test_prefix_affinity_follows_the_hit_until_the_load_guard() -> None:
    config = PrefixAffinitySettings(max_load_imbalance=2)
    cold, warm = _replica("cold"), _replica("warm")
    warm.state.record_prompt(PROMPT)
    policy = PrefixAffinity(config)
    assert policy.choose([cold, warm], PROMPT) == (warm, "prefix_hit")
    warm.state.in_flight = 2
    assert policy.choose([cold, warm], PROMPT) == (warm, "prefix_hit")
    warm.state.in_flight = 3  # three beyond the least loaded: one hot prefix must not pin it
    assert policy.choose([cold, warm], PROMPT) == (cold, "load_guard")
    assert policy.choose([cold, warm], PromptBlocks([7] * 40)).reason == "no_prefix_hit"


# ---- TTFT estimate ---------------------------------------------------------------------


def test_ttft_estimate_learns_per_token_time_from_first_tokens() -> None:
    state = EngineState(ema_weight=0.5, min_prefill_tokens_per_sample=64)
    assert state.estimate_ttft_s(100) is None  # not measured yet: admit
    first = state.enqueue_prefill(100, now=0.0)
    second = state.enqueue_prefill(300, now=0.0)
    assert (state.queued_prefills, state.queued_prefill_tokens) == (2, 400)
    state.finish_prefill(first, now=0.1, first_token=True)  # 100 tokens in 0.1 s
    assert state.prefill_s_per_token.value == pytest.approx(0.001)
    state.finish_prefill(second, now=0.8, first_token=True)  # 400 tokens of work in 0.8 s
    assert state.prefill_s_per_token.value == pytest.approx(0.0015)
    state.finish_prefill(second, now=9.0, first_token=False)  # closed tickets stay closed
    assert state.queued_prefills == 0
    state.enqueue_prefill(1000, now=1.0)
    assert state.estimate_ttft_s(200) == pytest.approx(1200 * 0.0015)


def test_short_and_aborted_prefills_do_not_teach_the_estimate() -> None:
    state = EngineState(min_prefill_tokens_per_sample=64)
    state.finish_prefill(state.enqueue_prefill(10, now=0.0), now=1.0, first_token=True)
    state.finish_prefill(state.enqueue_prefill(500, now=0.0), now=1.0, first_token=False)
    assert state.prefill_s_per_token.value is None
    assert state.enqueue_prefill(0, now=0.0).closed  # transferred KV: nothing to queue
    assert state.queued_prefills == 0


# ---- QoS -------------------------------------------------------------------------------


def test_priority_from_body_or_header_and_clear_errors() -> None:
    body = {"priority": "HIGH", "prompt": "x"}
    assert take_priority(body, {}, "normal") == "high"
    assert "priority" not in body  # vLLM's own `priority` is an integer
    assert take_priority({}, {"x-priority": "low"}, "normal") == "low"
    assert take_priority({}, {}, "normal") == "normal"
    with pytest.raises(Exception) as raised:
        take_priority({"priority": "urgent"}, {}, "normal")
    assert raised.value.status == HTTPStatus.BAD_REQUEST  # type: ignore[attr-defined]
    assert raised.value.param == "priority"  # type: ignore[attr-defined]


def _check(
    admission: AdmissionControl, priority: Priority, queued: int, estimate: float | None
) -> Refusal | None:
    return admission.check(priority, lambda: queued, lambda: estimate)


def test_admission_refuses_low_priority_over_slo_and_everyone_over_the_cap() -> None:
    config = QoSConfig(
        enabled=True,
        ttft_slo_s=1.0,
        early_rejection_s={"low": 1.0},
        queue_caps={"high": 10, "normal": 6, "low": 3},
    )
    admission = AdmissionControl(config)
    assert _check(admission, "low", 0, 0.9) is None
    assert _check(admission, "high", 0, 5.0) is None
    assert _check(admission, "normal", 0, 5.0) is None
    assert _check(admission, "low", 0, None) is None  # not measured yet
    slo = _check(admission, "low", 0, 1.5)
    assert slo is not None and slo.reason == "ttft_slo"
    cap = _check(admission, "normal", 6, None)
    assert cap is not None and cap.reason == "queue_full"
    assert _check(admission, "high", 9, None) is None
    assert _check(admission, "high", 10, None) is not None
    # What HTTP says of each: the server's load is a 503, the client's rate a 429.
    said = Rejection(slo)
    assert (said.status, said.reason) == (HTTPStatus.SERVICE_UNAVAILABLE, "ttft_slo")
    assert said.response().headers["retry-after"] == "1"
    assert Rejection(cap).status == HTTPStatus.TOO_MANY_REQUESTS


def test_admission_off_admits_everything_without_asking_for_its_inputs() -> None:
    def unasked() -> NoReturn:
        raise AssertionError("admission off must not scan the replicas")

    AdmissionControl(QoSConfig(enabled=False)).check("low", unasked, unasked)


def test_admission_asks_for_the_estimate_only_for_a_priority_with_a_limit() -> None:
    config = QoSConfig(enabled=True, early_rejection_s={"low": 1.0})
    asked: list[str] = []

    def estimate() -> float:
        asked.append("estimate")
        return 5.0

    assert AdmissionControl(config).check("high", lambda: 0, estimate) is None
    assert asked == []
    assert AdmissionControl(config).check("low", lambda: 0, estimate) is not None
    assert asked == ["estimate"]


# ---- prefill gate --------------------------------------------------------------------------


async def test_the_prefill_gate_lets_high_priority_overtake_waiting_work() -> None:
    from router.policies.prefill_gate import PrefillGate

    gate = PrefillGate(limit=1)
    order: list[str] = []

    async def request(name: str, priority: int) -> None:
        await gate.enter(priority)
        order.append(name)

    await gate.enter(0)  # the engine is busy with one prompt
    arrivals = (("low-1", 2), ("normal", 1), ("low-2", 2), ("high", 0))
    tasks = [asyncio.create_task(request(name, priority)) for name, priority in arrivals]
    await asyncio.sleep(0)
    assert gate.waiting == 4 and order == []
    for _ in range(4):
        gate.leave()  # a first token: the next prompt may enter
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["high", "normal", "low-1", "low-2"]


async def test_a_waiter_that_gives_up_passes_its_turn_on() -> None:
    from router.policies.prefill_gate import PrefillGate

    gate = PrefillGate(limit=1)
    await gate.enter(1)
    gone = asyncio.create_task(gate.enter(0))
    after = asyncio.create_task(gate.enter(2))
    await asyncio.sleep(0)
    gone.cancel()
    gate.leave()
    await asyncio.wait_for(after, 1)  # the cancelled high-priority waiter is skipped
    assert gate.waiting == 0


def test_the_estimate_counts_what_is_inside_and_what_waits_ahead_of_the_priority() -> None:
    state = EngineState()
    state.prefill_s_per_token.add(0.001)
    inside = state.enqueue_prefill(500, now=0.0, priority=2)
    state.enter_engine(inside)  # a low-priority prompt already in the engine
    state.enqueue_prefill(1000, now=0.0, priority=2)  # low priority waiting at the gate
    state.enqueue_prefill(200, now=0.0, priority=0)  # high priority waiting
    assert state.estimate_ttft_s(100, priority=0) == pytest.approx(0.8)
    assert state.estimate_ttft_s(100, priority=2) == pytest.approx(1.8)
    state.finish_prefill(inside, now=1.0, first_token=True)  # it left: only high ahead
    per_token = state.prefill_s_per_token.value
    assert per_token is not None
    assert state.estimate_ttft_s(100, priority=0) == pytest.approx(300 * per_token)


def test_high_priority_facing_a_full_prefill_pool_goes_where_it_starts_sooner() -> None:
    def decide(remote: float | None, local: float | None) -> tuple[str, str]:
        inputs = PrefillInputs(1000, 0, 10, 0, "high", remote, local)
        return _where_why(should_prefill_remotely(inputs, CHAPTER, QOS))

    assert decide(remote=3.0, local=1.0) == ("local", "high_priority_sooner_local")
    assert decide(remote=1.0, local=3.0) == ("remote", "high_priority")
    assert decide(remote=None, local=1.0) == ("remote", "high_priority")  # unmeasured


def test_a_prefill_pool_too_slow_for_the_slo_is_passed_over_for_a_sooner_decode() -> None:
    def decide(remote: float | None, local: float | None, qos: QoSConfig) -> tuple[str, str]:
        inputs = PrefillInputs(1000, 0, 3, 0, "high", remote, local)
        return _where_why(should_prefill_remotely(inputs, CHAPTER, qos))

    on = QoSConfig(enabled=True, ttft_slo_s=2.0)
    assert decide(remote=3.0, local=1.0, qos=on) == ("local", "remote_too_slow")
    assert decide(remote=3.0, local=4.0, qos=on) == ("remote", "long_prompt")  # still sooner
    assert decide(remote=1.5, local=0.2, qos=on) == ("remote", "long_prompt")  # within the SLO
    assert decide(remote=3.0, local=None, qos=on) == ("remote", "long_prompt")  # unmeasured
    off = QoSConfig(enabled=False, ttft_slo_s=2.0)
    assert decide(remote=3.0, local=1.0, qos=off) == ("remote", "long_prompt")


def test_the_remote_ttft_limit_can_sit_below_the_objective() -> None:
    settings = CHAPTER.model_copy(update={"remote_ttft_max_s": 1.0})
    on = QoSConfig(enabled=True, ttft_slo_s=2.0)
    inputs = PrefillInputs(1000, 0, 3, 0, "high", 1.5, 0.5)
    assert _where_why(should_prefill_remotely(inputs, settings, on)) == ("local", "remote_too_slow")
    assert _where_why(should_prefill_remotely(inputs, CHAPTER, on)) == ("remote", "long_prompt")
