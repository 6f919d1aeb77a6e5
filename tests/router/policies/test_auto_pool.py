"""An auto pool (shape auto) through the dispatcher, against fake engine links:
which engine decodes, which prefills, and why; no Ray, no vLLM engine."""

from __future__ import annotations

import asyncio

from vllm import SamplingParams

from deployments.config import parse_app_config
from engines.protocol import CONTINUE_FROM, EngineStats, GenerateChunk, GenerateRequest
from kv_transfer.handle import CONSUMER_KEY
from router.dispatch import (
    PEER_CHOICE,
    PREFILL_HEADER,
    PREFILL_REPLICA_HEADER,
    REPLICA_HEADER,
    Dispatch,
    Dispatcher,
)
from router.policies.qos import ENGINE_PRIORITY
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine
from router.settings import Priority
from tests.support.fake_engine import FIRST_TOKEN, FakeEngineLink, RecordingKV, handle_of

LONG = list(range(1, 1001))
SHORT = list(range(1, 11))
PER_TOKEN_S = 0.001


class RoleFreePool:
    """Mixed engines over fake links (two unless told), each able to prefill for another."""

    def __init__(
        self, transfer_s: float | None = None, engines: int = 2, split: str = "cost"
    ) -> None:
        config = parse_app_config(
            {
                "shape": "auto",
                "pools": [{"role": "mixed", "replicas": engines}],
                "router": {"replica_choice": "round_robin"},
                "prefill_policy": {"name": split},
            }
        )
        self.links = [
            FakeEngineLink(f"engine-{i}", "mixed", consumer=f"engine-{i}-consumer")
            for i in range(engines)
        ]
        self.engines = [PooledEngine(link.name, "mixed", link, 5.0) for link in self.links]
        for engine in self.engines:
            engine.state.update_engine(
                EngineStats(
                    replica=engine.name, role="mixed", kv_consumer=f"{engine.name}-consumer"
                )
            )
            engine.state.prefill_s_per_token.add(PER_TOKEN_S)  # as calibration leaves it
        self.kv = RecordingKV()
        self.dispatcher = Dispatcher(
            config.ingress_settings(), EnginePool(self.engines), self.kv, lambda _: transfer_s
        )

    def queue_prefill_on(self, index: int, tokens: int, priority: Priority = "normal") -> None:
        self.engines[index].state.enqueue_prefill(tokens, 0.0, ENGINE_PRIORITY[priority])

    def decoding_on(self, index: int, streams: int) -> None:
        """``streams`` requests in flight on the engine, as the router counts them."""
        self.engines[index].state.in_flight = streams

    def run(self, prompt: list[int], max_tokens: int = 4) -> tuple[Dispatch, list[GenerateChunk]]:
        async def scenario() -> tuple[Dispatch, list[GenerateChunk]]:
            request = GenerateRequest(
                "req-1", "", list(prompt), SamplingParams(max_tokens=max_tokens)
            )
            dispatch = self.dispatcher.start(self.dispatcher.plan(request, "normal"))
            try:
                chunks = [chunk async for chunk in dispatch.stream]
                await asyncio.sleep(0.01)
            finally:
                for engine in self.engines:
                    await engine.stop()
            return dispatch, chunks

        return asyncio.run(scenario())


def test_a_split_prompt_is_prefilled_by_the_peer_that_starts_it_soonest() -> None:
    pool = RoleFreePool(transfer_s=0.01, engines=3, split="always")
    pool.queue_prefill_on(1, 5000)  # round robin picks engine-0 to decode
    dispatch, chunks = pool.run(LONG, max_tokens=4)

    assert pool.links[1].submitted == []
    (prefill,) = pool.links[2].submitted
    assert prefill.sampling_params.max_tokens == 1
    assert prefill.kv_transfer_params == {
        "do_remote_decode": True,
        CONSUMER_KEY: "engine-0-consumer",
    }
    (decode,) = pool.links[0].submitted
    assert decode.prompt_token_ids == LONG
    assert decode.sampling_params.extra_args == {CONTINUE_FROM: [FIRST_TOKEN + len(LONG)]}
    assert decode.kv_transfer_params == {"do_remote_prefill": True, **handle_of(pool.links[2])}
    assert len([t for c in chunks for t in c.token_ids]) == 4
    headers = dispatch.response_headers()
    assert headers[REPLICA_HEADER] == "engine-0"
    assert headers[PREFILL_REPLICA_HEADER] == "engine-2"
    assert headers[PREFILL_HEADER] == "remote:always"
    assert dispatch.plan.prefill is not None and dispatch.plan.prefill.reason == PEER_CHOICE
    assert pool.dispatcher.policy_of(dispatch.plan.prefill, prefill=True) == PEER_CHOICE
    assert pool.dispatcher.policy_of(dispatch.plan.main) == "round_robin"


def test_a_peer_that_starts_it_sooner_takes_the_whole_request() -> None:
    """A split would queue the decode behind engine-0's own backlog: the peer that
    gives the first token sooner decodes it too, with no KV hand-over."""
    pool = RoleFreePool(transfer_s=0.01)
    pool.queue_prefill_on(0, 5000)  # round robin picks engine-0; engine-1 is idle
    pool.decoding_on(1, 3)  # even where the peer decodes more
    dispatch, chunks = pool.run(LONG, max_tokens=4)

    assert pool.links[0].submitted == []
    (whole,) = pool.links[1].submitted
    assert whole.prompt_token_ids == LONG
    assert whole.sampling_params.max_tokens == 4
    assert whole.kv_transfer_params is None  # no hand-over
    assert len([t for c in chunks for t in c.token_ids]) == 4
    headers = dispatch.response_headers()
    assert headers[REPLICA_HEADER] == "engine-1"
    assert headers[PREFILL_HEADER] == "local:peer_sooner"
    assert PREFILL_REPLICA_HEADER not in headers
    assert pool.dispatcher.policy_of(dispatch.plan.main) == PEER_CHOICE


def test_a_busy_decode_engine_hands_the_whole_request_to_a_less_busy_peer() -> None:
    pool = RoleFreePool(transfer_s=0.01)
    pool.decoding_on(0, 6)  # the cost policy's decode_load_threshold is 4
    pool.decoding_on(1, 2)
    dispatch, _ = pool.run(LONG)

    assert pool.links[0].submitted == []
    assert [r.kv_transfer_params for r in pool.links[1].submitted] == [None]
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:peer_less_busy"


def test_the_peer_is_chosen_by_the_work_ahead_of_the_prompts_own_priority() -> None:
    """engine-1 holds more waiting work, but engine-2's goes first: all of it high
    priority, ahead of a normal prompt. Counted as high priority (the prompt's own work
    ahead only), engine-1 would look idle."""
    pool = RoleFreePool(transfer_s=0.01, engines=3)
    pool.queue_prefill_on(0, 9000)  # round robin picks engine-0; it is queued up
    pool.queue_prefill_on(1, 3000, "normal")
    pool.queue_prefill_on(2, 2000, "high")
    dispatch, _ = pool.run(LONG, max_tokens=4)

    assert dispatch.response_headers()[REPLICA_HEADER] == "engine-2"
    assert [len(link.submitted) for link in pool.links] == [0, 0, 1]


def test_a_short_prompt_runs_where_it_decodes() -> None:
    pool = RoleFreePool()
    pool.queue_prefill_on(0, 5000)
    dispatch, _ = pool.run(SHORT)

    assert pool.links[1].submitted == []
    assert [r.prompt_token_ids for r in pool.links[0].submitted] == [SHORT]
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:short_prompt"


def test_a_slow_hand_over_keeps_a_long_prompt_local() -> None:
    pool = RoleFreePool(transfer_s=1.0)
    pool.queue_prefill_on(0, 5000)
    dispatch, _ = pool.run(LONG)

    assert pool.links[1].submitted == []
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:transfer_too_slow"


def test_equal_engines_keep_the_prompt_where_it_decodes() -> None:
    pool = RoleFreePool(transfer_s=0.01)
    dispatch, _ = pool.run(LONG)

    assert pool.links[1].submitted == []
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:local_sooner"


def test_with_no_healthy_peer_the_decode_engine_prefills() -> None:
    pool = RoleFreePool()
    pool.queue_prefill_on(0, 5000)
    pool.engines[1].healthy = False
    dispatch, _ = pool.run(LONG)

    assert pool.links[1].submitted == []
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:no_peer"


def test_an_engine_that_cannot_take_a_request_is_replanned_on_the_other() -> None:
    pool = RoleFreePool()
    plan = pool.dispatcher.plan(GenerateRequest("r", "", SHORT, SamplingParams()), "normal")
    elsewhere = pool.dispatcher.replan_elsewhere(plan)

    assert elsewhere is not None
    assert elsewhere.main.engine.name != plan.main.engine.name
