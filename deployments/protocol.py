"""What crosses between the router and an engine replica (through Ray, pickled).

Kept small on purpose: token ids in, token deltas out. The router owns the OpenAI
surface; an engine replica only runs vLLM on token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

EngineRole = Literal["mixed", "prefill", "decode"]


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    # Which router process receives this request's deltas (see EngineReplica.deltas).
    subscriber: str
    prompt_token_ids: list[int]
    # A vllm.SamplingParams; typed loosely so the router need not import vLLM's engine.
    sampling_params: Any
    # Opaque to the router: produced by one engine's KV connector, consumed by another's.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class GenerateChunk:
    """New tokens of one engine step (stream) or the whole answer (non-stream)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class GenerateFailure:
    """The engine could not finish a request; ends that request's deltas."""

    message: str


# One item of an engine's delta stream: every (request id, delta) ready since the last.
DeltaBatch = list[tuple[str, GenerateChunk | GenerateFailure]]


@dataclass(slots=True)
class EngineStats:
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
