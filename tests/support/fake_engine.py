"""A scriptable EngineLink: the router's side of an engine without Ray or vLLM.

It answers each submitted request with ``max_tokens`` tokens on its subscriber's delta
stream, as an engine host would; a prefill request (``do_remote_decode``) gets a KV
handle with its last delta, as the object-store connector's would. ``fail`` makes it
end requests with a GenerateFailure instead. It implements the whole ``EngineLink``
contract (mypy checks ``_as_link``), LoRA adapters included.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from engines.contract import EngineLink
from engines.delta_streams import DeltaStreams
from engines.protocol import (
    CONTINUE_FROM,
    DeltaBatch,
    EngineRole,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
)
from kv_transfer.handle import remote_decode_params, remote_prefill_params

FIRST_TOKEN = 100


class FakeEngineLink:
    def __init__(self, name: str, role: EngineRole, consumer: str | None = None) -> None:
        self.name = name
        self.role = role
        self.consumer = consumer
        self.fail = False
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.adapters: set[str] = set()
        self.shut_down = False
        self._streams = DeltaStreams()
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, request: GenerateRequest) -> None:
        self.submitted.append(request)
        task = asyncio.get_running_loop().create_task(self._answer(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        return self._streams.stream(subscriber, lambda _: None)

    async def stats(self) -> EngineStats:
        return EngineStats(replica=self.name, role=self.role, kv_consumer=self.consumer)

    async def check_health(self) -> None:
        return None

    async def wait_ready(self) -> None:
        return None

    @property
    def ready(self) -> bool:
        return True

    async def add_lora(self, adapter: LoraAdapter) -> None:
        self.adapters.add(adapter.name)

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        self.adapters.discard(adapter.name)

    def shutdown(self) -> None:
        self.shut_down = True

    async def _answer(self, request: GenerateRequest) -> None:
        outbox = self._streams.outbox(request.subscriber)
        await asyncio.sleep(0)
        if self.fail:
            outbox.put_nowait((request.request_id, GenerateFailure(f"{self.name} failed")))
            return
        params = request.sampling_params
        prefill = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        # A handed-over request samples the prefill engine's tokens first, as vLLM does
        # under engines/continuation.py's processor.
        forced = (params.extra_args or {}).get(CONTINUE_FROM, [])
        for index in range(params.max_tokens):
            last = index == params.max_tokens - 1
            handle = {"transfer_id": f"kv-{request.request_id}"} if prefill and last else None
            token = forced[index] if index < len(forced) else None
            chunk = GenerateChunk(
                token_ids=[FIRST_TOKEN + len(request.prompt_token_ids) + index]
                if token is None
                else [token],
                text="x",
                finish_reason="length" if last else None,
                num_prompt_tokens=len(request.prompt_token_ids),
                kv_transfer_params=handle,
            )
            outbox.put_nowait((request.request_id, chunk))
            await asyncio.sleep(0)


def _as_link(link: FakeEngineLink) -> EngineLink:
    return link  # mypy: the fake is a whole EngineLink


def handle_of(link: FakeEngineLink) -> dict[str, Any]:
    """The KV handle this prefill link gave its last request."""
    return {"transfer_id": f"kv-{link.submitted[-1].request_id}"}


class RecordingKV:
    """The router's side of a KV backend (``KVRouterSide``) that records releases."""

    def __init__(self) -> None:
        self.released: list[dict[str, Any]] = []

    def prefill_params(self, consumer: str | None) -> dict[str, Any]:
        return remote_decode_params(consumer)

    def decode_params(self, handle: dict[str, Any] | None) -> dict[str, Any]:
        return remote_prefill_params(handle)

    def release(self, handle: dict[str, Any]) -> None:
        self.released.append(handle)

    async def ledger_snapshot(self) -> dict[str, Any] | None:
        return None

    def shutdown(self) -> None:
        return None
