"""What the scheduler half tells the worker half to do in one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class SaveOrder:
    """Prefill side: this step completes the prompt; put these blocks (every layer)."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    num_parts: int
    ttl_s: float
    # The decode engine (consumer_id) the router chose, to push the part to; or None.
    consumer: str | None = None


@dataclass(frozen=True, slots=True)
class LoadOrder:
    """Decode side: write transferred blocks ``first_source_block...`` into ``block_ids``."""

    request_id: str
    transfer_id: str
    first_source_block: int
    block_ids: list[int]
    # The part was pushed to this engine: wait for it rather than claim it.
    pushed: bool = False
    # Set when the blocks were allocated but must not be loaded: the worker reports them
    # as load errors, so vLLM recomputes them (every accepted async load needs an answer).
    problem: str | None = None


@dataclass
class TransferOrders(KVConnectorMetadata):
    saves: list[SaveOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    # Requests with a SaveOrder that vLLM has finished since the last step; their blocks
    # stay allocated until the worker reports the put done (``finished_sending``).
    finished_saves: list[str] = field(default_factory=list)
