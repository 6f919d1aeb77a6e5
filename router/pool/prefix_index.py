"""What each engine holds in its prefix cache, as the router sees it.

vLLM caches KV per full block and finds a prompt's cached prefix by chaining block
hashes, each over its parent's hash and its own tokens; the router chains its own
hashes the same way (``engines.kv_events.chain_hash``). Two sources:
- ``BlockIndex``: the engine's own KV events (engines/kv_events.py), exact, evictions
  included; used wherever the engine publishes them.
- ``PrefixIndex``: a mirror of what the router sent, bounded by the engine's KV capacity
  and forgetting least recently used blocks first, as vLLM's free-block queue does; it
  cannot see evictions forced by other traffic (the fallback where events are off).
Both are checked against the ``num_cached_tokens`` vLLM reports
(``splitserve_prefix_cache_tokens_total``, ``splitserve_prefix_estimate_error_tokens``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Any

from engines.kv_events import chain_hashes
from engines.protocol import CacheUpdate

# Pending blocks beyond the held ones that trigger a sweep of the expired: they pile up
# only where sent prompts never reach the engine (aborted), so the sweep is rare.
PENDING_SWEEP_SLACK = 4096


class PromptBlocks:
    """A prompt's chained block hashes, computed once per block size however many
    engines are asked about it."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = chain_hashes(self.token_ids, block_size)
        return self._hashes[block_size]

    def cacheable_tokens(self, block_size: int, hit_blocks: int) -> int:
        # vLLM recomputes at least the last prompt token to get its logits, so a full hit
        # is worth one block less when the prompt ends on a block boundary.
        return min(hit_blocks * block_size, (len(self.token_ids) - 1) // block_size * block_size)


def leading_hits(prompt: PromptBlocks, block_size: int, held: Container[int]) -> int:
    """Leading prompt tokens found among ``held`` block hashes (anything with ``in``)."""
    hits = 0
    for block_hash in prompt.hashes(block_size):
        if block_hash not in held:
            break
        hits += 1
    return prompt.cacheable_tokens(block_size, hits) if hits else 0


class BlockIndex:
    """One engine's cached blocks as its KV events report them, and the blocks of prompts
    sent to it that its events have not confirmed yet.

    A block is stored only once computed, but a request with the same prefix that comes
    while the first is still prefilling finds it cached by the time it runs; so a sent
    prompt's blocks count as held for ``pending_s`` unless an event stores them first
    (the events own them then) or removes them.
    """

    def __init__(self, pending_s: float = 0.0) -> None:
        self._pending_s = pending_s
        self._names: dict[Any, int] = {}  # vLLM's block hash -> the router's
        # The router's hashes held, by how many of vLLM's blocks carry each (two requests
        # computing one prefix at once may each store a block of the same content).
        self._held: dict[int, int] = {}
        self._pending: dict[int, float] = {}  # the router's hash -> until when

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._held:
            return True
        until = self._pending.get(block_hash)  # type: ignore[call-overload]
        return until is not None and until > time.monotonic()

    def cached_tokens(self, prompt: PromptBlocks, block_size: int) -> int:
        """Leading prompt tokens the engine holds (its block size, from its stats)."""
        return leading_hits(prompt, block_size, self)

    def expect(self, prompt: PromptBlocks, block_size: int) -> None:
        """The prompt was sent to this engine: its blocks are about to be stored."""
        if self._pending_s <= 0:
            return
        now = time.monotonic()
        until = now + self._pending_s
        if len(self._pending) > len(self._held) + PENDING_SWEEP_SLACK:
            self._pending = {h: t for h, t in self._pending.items() if t > now}
        for block_hash in prompt.hashes(block_size):
            if block_hash not in self._held:
                self._pending[block_hash] = until

    def apply(self, update: CacheUpdate) -> None:
        """Idempotent per block: a snapshot may repeat changes that crossed it."""
        # Per block, for every engine's events: the offline simulation's hottest loop.
        names, held, forget = self._names, self._held, self._pending.pop
        if update.cleared:
            names.clear()
            held.clear()
        for vllm_hash, ours in update.stored:
            forget(ours, None)
            if vllm_hash not in names:
                names[vllm_hash] = ours
                held[ours] = held.get(ours, 0) + 1
        for vllm_hash in update.removed:
            removed = names.pop(vllm_hash, None)
            if removed is not None:
                forget(removed, None)
                left = held.get(removed, 0) - 1
                if left > 0:
                    held[removed] = left
                else:
                    held.pop(removed, None)


class PrefixIndex:
    """One engine's cached blocks as the router believes them, least recently used first."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("a prefix index needs a block size and a capacity of at least 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        """Leading prompt tokens this engine should find in its prefix cache."""
        return leading_hits(prompt, self.block_size, self._blocks)

    def record(self, prompt: PromptBlocks) -> None:
        """The engine computed (or loaded) this prompt: its full blocks are now cached."""
        blocks, to_end = self._blocks, self._blocks.move_to_end
        for block_hash in prompt.hashes(self.block_size):
            blocks[block_hash] = None
            to_end(block_hash)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
