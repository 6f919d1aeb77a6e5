"""PD's request flow and the dispatcher against fake engine links: no Ray, no vLLM engine.

The serving tests (tests/deployments/test_pd_served.py) check the same flow with real
engines and real KV; these check its branches quickly: the hand-over, each fallback,
and that a KV handle nobody will load is released.
"""

from __future__ import annotations

import asyncio

from vllm import SamplingParams

from deployments.config import parse_app_config
from engines.protocol import CONTINUE_FROM, EngineStats, GenerateChunk, GenerateRequest
from kv_transfer.handle import CONSUMER_KEY
from router.dispatch import Dispatch, Dispatcher
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine
from splitserve.metric_catalogue import PREFILL_HEADER, REPLICA_HEADER
from tests.support.fake_engine import FIRST_TOKEN, FakeEngineLink, RecordingKV, handle_of

PROMPT = list(range(1, 301))
CONSUMER = "decode-0-consumer"


class Cluster:
    """One prefill and one decode client over fake links, and the KV handles released."""

    def __init__(self, policy: str = "always") -> None:
        config = parse_app_config(
            {
                "shape": "pd",
                "pools": [{"role": "prefill"}, {"role": "decode"}],
                "prefill_policy": {"name": policy},
            }
        )
        self.prefill_link = FakeEngineLink("prefill-0", "prefill")
        self.decode_link = FakeEngineLink("decode-0", "decode", consumer=CONSUMER)
        self.prefill = PooledEngine("prefill-0", "prefill", self.prefill_link, 5.0)
        self.decode = PooledEngine("decode-0", "decode", self.decode_link, 5.0)
        self.decode.state.update_engine(
            EngineStats(replica="decode-0", role="decode", kv_consumer=CONSUMER)
        )
        self.kv = RecordingKV()
        self.released = self.kv.released
        self.dispatcher = Dispatcher(
            config.ingress_settings(), EnginePool([self.prefill, self.decode]), self.kv
        )

    def start(self, max_tokens: int) -> Dispatch:
        request = GenerateRequest("req-1", "", list(PROMPT), SamplingParams(max_tokens=max_tokens))
        return self.dispatcher.start(self.dispatcher.plan(request, "normal"))

    def run(self, max_tokens: int, keep: int | None = None) -> tuple[Dispatch, list]:
        """One request through the dispatcher; ``keep``: the client leaves after that many
        chunks."""

        async def scenario() -> tuple[Dispatch, list[GenerateChunk]]:
            dispatch = self.start(max_tokens)
            chunks = []
            try:
                async for chunk in dispatch.stream:
                    chunks.append(chunk)
                    if keep is not None and len(chunks) == keep:
                        await dispatch.stream.aclose()
                        break
                await asyncio.sleep(0.01)  # let aborts and releases run
            finally:
                await self.prefill.stop()
                await self.decode.stop()
            return dispatch, chunks

        return asyncio.run(scenario())


def _tokens(chunks: list[GenerateChunk]) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


def test_remote_prefill_hands_the_first_token_and_the_kv_to_decode() -> None:
    cluster = Cluster()
    dispatch, chunks = cluster.run(max_tokens=5)

    (prefill_request,) = cluster.prefill_link.submitted
    assert prefill_request.sampling_params.max_tokens == 1
    assert prefill_request.kv_transfer_params == {"do_remote_decode": True, CONSUMER_KEY: CONSUMER}
    (decode_request,) = cluster.decode_link.submitted
    first = FIRST_TOKEN + len(PROMPT)
    # The same request, continuing from the first token (forced, engines/continuation.py).
    assert decode_request.prompt_token_ids == PROMPT
    assert decode_request.sampling_params.max_tokens == 5
    assert decode_request.sampling_params.extra_args == {CONTINUE_FROM: [first]}
    assert decode_request.kv_transfer_params == {
        "do_remote_prefill": True,
        **handle_of(cluster.prefill_link),
    }
    assert len(_tokens(chunks)) == 5 and _tokens(chunks)[0] == first
    assert chunks[0].finish_reason is None and chunks[-1].finish_reason == "length"
    assert (dispatch.decision.where, dispatch.decision.reason) == ("remote", "always")
    assert dispatch.headers[REPLICA_HEADER] == "decode-0"
    assert cluster.released == []  # the decode engine loaded it


def test_a_failed_prefill_is_computed_again_on_the_decode_replica() -> None:
    cluster = Cluster()
    cluster.prefill_link.fail = True
    dispatch, chunks = cluster.run(max_tokens=5)

    (decode_request,) = cluster.decode_link.submitted
    assert decode_request.prompt_token_ids == PROMPT
    assert decode_request.sampling_params.max_tokens == 5
    assert decode_request.kv_transfer_params is None
    assert len(_tokens(chunks)) == 5
    assert (dispatch.decision.where, dispatch.decision.reason) == ("local", "prefill_failed")


def test_a_one_token_answer_never_reaches_decode_and_frees_its_kv() -> None:
    cluster = Cluster()
    _, chunks = cluster.run(max_tokens=1)

    assert cluster.decode_link.submitted == []
    assert len(_tokens(chunks)) == 1 and chunks[0].finish_reason == "length"
    assert cluster.released == [handle_of(cluster.prefill_link)]


def test_a_client_gone_after_the_first_token_frees_the_kv() -> None:
    cluster = Cluster()
    _, chunks = cluster.run(max_tokens=50, keep=1)

    assert len(chunks) == 1
    assert cluster.released == [handle_of(cluster.prefill_link)]


def test_an_unhealthy_prefill_pool_means_local_prefill() -> None:
    cluster = Cluster()
    cluster.prefill.healthy = False
    dispatch, chunks = cluster.run(max_tokens=3)

    assert cluster.prefill_link.submitted == []
    assert len(_tokens(chunks)) == 3
    assert dispatch.decision.where == "local"
    assert dispatch.response_headers()[PREFILL_HEADER] == "local:prefill_unavailable"


def test_never_keeps_every_prompt_on_the_decode_replica() -> None:
    cluster = Cluster(policy="never")
    dispatch, _ = cluster.run(max_tokens=3)

    assert cluster.prefill_link.submitted == []
    assert [r.prompt_token_ids for r in cluster.decode_link.submitted] == [PROMPT]
    assert dispatch.decision.where == "local"
