"""One request across a prefill engine and a decode engine (PD disaggregation).

The decode engine is chosen first and named in the prefill request. The prefill
engine computes the prompt and the first token; its KV blocks go into Ray's object
store, pushed towards that decode engine, and the handle comes back in
``kv_transfer_params``. The first token is streamed to the client at once. The decode
engine then gets the same prompt, loads the transferred KV instead of recomputing it,
samples the token(s) the client already has again, forced (engines/continuation.py), so
that its grammar, penalties, stop strings and seeded generator carry on from them as on
one engine, and streams what follows. If the prefill engine is missing or fails, the
decode engine prefills locally.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec

from engines.contract import EngineFailed
from engines.protocol import CONTINUE_FROM, GenerateChunk, GenerateRequest
from kv_transfer import KVRouterSide
from router.policies.prefill_policy import PrefillDecision
from router.pool.mailbox import join_into
from router.pool.pooled_engine import PooledEngine

logger = logging.getLogger("splitserve.router")

# Decisions where the decode engine prefilled although the plan was remote.
PREFILL_FALLBACK_REASONS = ("prefill_failed", "no_prefill_replica")


class PrefillDecodeFlow:
    def __init__(self, kv: KVRouterSide) -> None:
        # The KV backend's side of the hand-over: the prefill and the decode request's
        # params, and releasing transferred KV nobody will load (client gone).
        self._kv = kv

    async def run(
        self,
        request: GenerateRequest,
        decode: PooledEngine,
        prefill: PooledEngine | None,
        decision: PrefillDecision,
        fell_back: Callable[[PrefillDecision], None],
        prefill_tokens: int | None = None,
        on_accepted: Callable[[], None] | None = None,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Deltas of the whole answer. Where the prompt cannot run remotely as
        ``decision`` planned, ``fell_back`` hears where it runs instead, before the first
        delta. ``prefill_tokens``: prompt tokens left to compute after the expected
        prefix-cache hit, on whichever engine prefills (see PooledEngine.generate)."""
        first: GenerateChunk | None = None
        if prefill is not None:
            try:
                first = await self._prefill(
                    prefill, request, prefill_tokens, on_accepted, _consumer_of(decode)
                )
            except EngineFailed as error:
                logger.warning("prefill on %s failed, prefilling locally: %s", prefill.name, error)
                decision = decision.fallen_back("prefill_failed")
                fell_back(decision)
                prefill_tokens = None  # the decode engine's cache was not what was planned
        if first is None:
            if decision.remote:
                fell_back(decision.fallen_back("no_prefill_replica"))
            async for chunk in decode.generate(request, prefill_tokens, on_accepted):
                yield chunk
            return
        handle = first.kv_transfer_params
        if first.finish_reason == "stop" or request.sampling_params.max_tokens <= 1:
            self._release(handle)
            yield first
            return
        consumed = False
        try:
            # Inside the try: a client that leaves at the first token must free the KV too.
            yield msgspec.structs.replace(first, finish_reason=None, stop_reason=None)
            decode_request = _decode_request(request, first, self._kv.decode_params(handle))
            already_sent = _AlreadySent(first)
            async for chunk in decode.generate(decode_request, prefill_tokens=0):
                consumed = True
                if rest := already_sent.drop_from(chunk):
                    yield rest
        finally:
            if not consumed:
                self._release(handle)

    async def _prefill(
        self,
        prefill: PooledEngine,
        request: GenerateRequest,
        prefill_tokens: int | None,
        on_accepted: Callable[[], None] | None,
        consumer: str | None,
    ) -> GenerateChunk:
        params = request.sampling_params.clone()
        params.max_tokens = 1
        params.min_tokens = min(params.min_tokens, 1)
        prefill_request = msgspec.structs.replace(
            request,
            request_id=f"{request.request_id}-prefill",
            sampling_params=params,
            kv_transfer_params=self._kv.prefill_params(consumer),
        )
        first: GenerateChunk | None = None
        async for chunk in prefill.generate(prefill_request, prefill_tokens, on_accepted):
            if first is None:
                first = chunk
            else:
                join_into(first, chunk)
        if first is None or not first.token_ids:
            raise EngineFailed(f"{prefill.name} returned no first token")
        return first

    def _release(self, handle: dict[str, Any] | None) -> None:
        if handle:
            try:
                self._kv.release(handle)
            except Exception as error:  # the TTL frees it anyway
                logger.warning("could not release KV transfer %s: %s", handle, error)


def _consumer_of(decode: PooledEngine) -> str | None:
    """The decode engine's KV consumer id, once its engine has reported one."""
    stats = decode.state.engine
    return stats.kv_consumer if stats is not None else None


def _decode_request(
    request: GenerateRequest, first: GenerateChunk, kv_transfer_params: dict[str, Any]
) -> GenerateRequest:
    """The request as it was, continuing from ``first``'s tokens (forced)."""
    params = request.sampling_params.clone()
    params.extra_args = {**(params.extra_args or {}), CONTINUE_FROM: list(first.token_ids)}
    # The prefill engine computed the prompt, and sent its logprobs with the first token.
    params.prompt_logprobs = None
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}-decode",
        sampling_params=params,
        kv_transfer_params=kv_transfer_params,
    )


class _AlreadySent:
    """Takes what the client already has from the prefill engine off the front of the
    decode engine's output: the same tokens, detokenized the same way, since both
    engines saw the same prompt and the same first tokens as output."""

    def __init__(self, first: GenerateChunk) -> None:
        self._tokens = len(first.token_ids)
        self._text = first.text

    def drop_from(self, chunk: GenerateChunk) -> GenerateChunk | None:
        """``chunk`` without what was sent already; None if nothing is left of it."""
        if not self._tokens:
            return chunk
        dropped = min(self._tokens, len(chunk.token_ids))
        self._tokens -= dropped
        text = chunk.text
        if text.startswith(self._text):
            text, self._text = text[len(self._text) :], ""
        logprobs = chunk.logprobs[dropped:] if chunk.logprobs is not None else None
        rest = msgspec.structs.replace(
            chunk, token_ids=chunk.token_ids[dropped:], text=text, logprobs=logprobs
        )
        if rest.token_ids or rest.text or rest.finish_reason is not None:
            return rest
        return None
