"""One request's deltas on their way from the router's listener to its reader.

A chunk that arrives while the one before it is still unread joins it, as vLLM's
output collector merges the deltas of a consumer that lags: a reader that is behind
reads one chunk of several tokens instead of several chunks, and writes one event of
them, as vLLM's server does. So the router's work per token falls as its load rises,
instead of the backlog growing; a reader that keeps up reads every chunk as it came.
"""

from __future__ import annotations

import asyncio
from collections import deque

from engines.protocol import GenerateChunk, GenerateFailure

Delta = GenerateChunk | GenerateFailure


def joinable(unread: GenerateChunk, later: GenerateChunk) -> bool:
    """Whether ``later`` continues ``unread`` in one chunk: the same completion, which
    ``unread`` did not finish, and no hand-over handle to keep apart."""
    return (
        unread.index == later.index
        and unread.finish_reason is None
        and unread.kv_transfer_params is None
    )


def join_into(unread: GenerateChunk, later: GenerateChunk) -> None:
    """Append ``later`` to ``unread``, which nobody else holds yet (it is unread)."""
    unread.token_ids += later.token_ids
    unread.text += later.text
    if later.logprobs is not None:
        unread.logprobs = [*(unread.logprobs or ()), *later.logprobs]
    unread.prompt_logprobs = unread.prompt_logprobs or later.prompt_logprobs
    unread.finish_reason = later.finish_reason
    unread.stop_reason = later.stop_reason
    unread.num_prompt_tokens = max(unread.num_prompt_tokens, later.num_prompt_tokens)
    unread.num_cached_tokens = max(unread.num_cached_tokens, later.num_cached_tokens)
    unread.kv_transfer_params = later.kv_transfer_params or unread.kv_transfer_params


class DeltaMailbox:
    """A request's unread deltas, the last chunk open to the next one (``joinable``)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[Delta] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, delta: Delta) -> None:
        items = self._items
        if items and isinstance(delta, GenerateChunk):
            unread = items[-1]
            if isinstance(unread, GenerateChunk) and joinable(unread, delta):
                join_into(unread, delta)
                return
        items.append(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Delta:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()
