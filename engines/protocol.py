"""What crosses between the router and an engine.

Token ids and vLLM's ``SamplingParams`` in; per engine step, every request's token
deltas out (with their logprobs, each of ``n`` completions by index, and a remote
prefill's KV handle), and alongside them the engine's stats and its prefix cache's
changes (KV events). Control calls load and free LoRA adapters. The router owns the
OpenAI surface (its own path, or vLLM's serving layer over the dispatch); an engine
runs vLLM, or a simulated or synthetic backend, on token ids only.

Every type is a msgspec struct, as vLLM's own engine messages are: the engine transport
(engines/transport.py) sends them as msgpack, data only, and decodes each frame into
exactly these types, so no frame can name a class to build. ``array_like`` keeps a
per-token chunk to a short array; ``tag`` lets a delta's union be decoded.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

EngineRole = Literal["mixed", "prefill", "decode"]


class LoraAdapter(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter as engines load it: vLLM's LoRARequest, as data."""

    name: str
    int_id: int  # vLLM's id for it, unique among the adapters an engine holds
    path: str


# A turn's bits below the priority's in ``GenerateRequest.scheduling_priority``: vLLM
# carries priorities as int64, and three priorities' turns fit.
TURN_BITS = 48
TURN_LIMIT = (1 << TURN_BITS) - 1


class GenerateRequest(msgspec.Struct, array_like=True):
    request_id: str
    # Which router process receives this request's deltas (see EngineReplica.deltas).
    subscriber: str
    prompt_token_ids: list[int]
    # A vllm.SamplingParams. Typed loosely so that importing the protocol does not import
    # vLLM (seconds); the engine's side of the transport decodes it into its type.
    sampling_params: Any
    # Opaque to the router: produced by one engine's KV connector, consumed by another's.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's scheduling priority (lower runs first); used where the engine schedules by
    # priority, ignored by first-come-first-served engines.
    priority: int = 0
    # The router's event-loop time at which it gives up on the request and aborts it
    # (router.request_timeout_s); meaningless in other processes, ignored by engines.
    deadline: float | None = None
    # The adapter the request runs with; None for the base model.
    lora: LoraAdapter | None = None
    # Its place among its priority's requests by its API key's fair share (lower first;
    # router/policies/fair_share.py); 0 where no shares are kept.
    turn: int = 0

    def scheduling_priority(self) -> int:
        """What an engine that schedules by priority orders by, then by arrival: the
        priority, then the turn within it. A turn past TURN_LIMIT (2**38 requests of a
        weight-1 key at one priority) orders by arrival only."""
        return (self.priority << TURN_BITS) | min(self.turn, TURN_LIMIT)


# SamplingParams.extra_args key: the token ids a handed-over request's output must start
# with, sampled again (forced) on the decode engine (engines/continuation.py).
CONTINUE_FROM = "splitserve_continue_from"


# One position's logprobs as vLLM returns them: the sampled (or prompt) token first, then
# the top ones by rank; (token id, logprob, rank, the token as text or None).
TokenLogprobs = list[tuple[int, float, int | None, str | None]]


class GenerateChunk(msgspec.Struct, array_like=True, tag="chunk"):
    """New tokens of one engine step (stream) or the whole answer (non-stream), of one
    of the request's ``n`` completions (``index``)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    index: int = 0
    # One entry per token of ``token_ids``, where the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # Once per request (its first chunk), where it asked for them: one entry per prompt
    # token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class GenerateFailure(msgspec.Struct, array_like=True, tag="failure"):
    """The engine could not finish a request; ends that request's deltas."""

    message: str
    # The engine itself died: the request may be sent again (to it once restarted).
    engine_dead: bool = False


class CacheUpdate(msgspec.Struct, array_like=True, tag="cache"):
    """A change to an engine's prefix cache, from its KV events (engines/kv_events.py).

    stored: (vLLM's block hash, the router's chained hash of the same block);
    removed: vLLM's block hashes; cleared: forget every block first (a snapshot sets
    cleared and lists every block it holds).
    """

    # vLLM's block hashes are bytes or ints (ExternalBlockHash).
    stored: list[tuple[bytes | int, int]] = msgspec.field(default_factory=list)
    removed: list[bytes | int] = msgspec.field(default_factory=list)
    cleared: bool = False


# The request id under which cache updates travel on a delta stream (no request has it).
CACHE_UPDATES = ""

# One item of an engine's delta stream: every (request id, delta) ready since the last.
DeltaBatch = list[tuple[str, GenerateChunk | GenerateFailure | CacheUpdate]]


class EngineStats(msgspec.Struct, array_like=True):
    """One replica's load as its engine last reported it."""

    replica: str
    role: EngineRole
    num_running: int = 0
    num_waiting: int = 0
    # Requests the engine's front end still holds (running, waiting or being aborted).
    num_unfinished: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    reported_at: float = 0.0
    # The KV cache's shape, for the router's prefix-cache mirror.
    block_size: int = 0
    kv_capacity_blocks: int = 0
    # Prompt tokens since the engine started, by where they came from as vLLM counts them:
    # local_compute, local_cache_hit, external_kv_transfer.
    prompt_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # How a prefill request names this engine as its KV's consumer (decode engines of PD).
    kv_consumer: str | None = None
    # The context the engine was given (vLLM derives it from the model unless set): the
    # router refuses what does not fit; 0 where the engine has no model.
    max_model_len: int = 0
    # The KV connector's transfer statistics since the engine started, a
    # ``TransferTotals``' numbers (kv_transfer/metrics.py); None if it has moved none.
    kv_transfer: dict[str, Any] | None = None
