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

import math
import time
from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence
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


class PrefixHolders:
    """Which engines hold each block, pool-wide: the inverse of every engine's
    ``BlockIndex``, so that "who holds this prompt's longest prefix" costs the prompt's
    blocks, not one look per engine. A block held until an eviction says otherwise is
    held for ever (``math.inf``); one a sent prompt is expected to store, until its
    pending time is over."""

    def __init__(self) -> None:
        self._holders: dict[int, dict[Hashable, float]] = {}

    def hold(self, block: int, engine: Hashable, until: float = math.inf) -> None:
        holders = self._holders.setdefault(block, {})
        if holders.get(engine, -math.inf) < until:
            holders[engine] = until

    def release(self, block: int, engine: Hashable) -> None:
        holders = self._holders.get(block)
        if holders is not None and holders.pop(engine, None) is not None and not holders:
            del self._holders[block]

    def deepest(self, hashes: Sequence[int]) -> tuple[int, list[Hashable]]:
        """How many of a prompt's leading blocks (``hashes``, one block size's) some engine
        holds, and the engines that hold the last of them: those with its longest cached
        prefix. A binary search over the blocks, since an engine that holds a block holds
        the blocks before it (a chained hash names its whole prefix, and vLLM evicts a
        chain's blocks tail first): log(blocks) looks, whatever the fleet."""
        now = time.monotonic()
        low, high = 0, len(hashes)  # some holder at blocks < low; none at blocks >= high
        while low < high:
            middle = (low + high) // 2
            if self._live(hashes[middle], now):
                low = middle + 1
            else:
                high = middle
        if not low:
            return 0, []
        return low, self._live(hashes[low - 1], now)

    def _live(self, block: int, now: float) -> list[Hashable]:
        holders = self._holders.get(block)
        return [engine for engine, until in holders.items() if until > now] if holders else []


class BlockIndex:
    """One engine's cached blocks as its KV events report them, and the blocks of prompts
    sent to it that its events have not confirmed yet.

    A block is stored only once computed, but a request with the same prefix that comes
    while the first is still prefilling finds it cached by the time it runs; so a sent
    prompt's blocks count as held for ``pending_s`` unless an event stores them first
    (the events own them then) or removes them.
    """

    def __init__(
        self,
        pending_s: float = 0.0,
        holders: PrefixHolders | None = None,
        owner: Hashable = None,
    ) -> None:
        """``holders``: the pool's inverse index, told of every block this engine
        (``owner``) holds or is expected to."""
        self._pending_s = pending_s
        self._pool = holders
        self._owner = owner
        self._names: dict[Any, int] = {}  # vLLM's block hash -> the router's
        # The router's hashes held, by how many of vLLM's blocks carry each (two requests
        # computing one prefix at once may each store a block of the same content).
        self._held: dict[int, int] = {}
        self._pending: dict[int, float] = {}  # the router's hash -> until when

    def __len__(self) -> int:
        return len(self._held)

    def keep_holders(self, holders: PrefixHolders, owner: Hashable) -> None:
        """Tell ``holders`` (as ``owner``) of what this index holds now and from now on."""
        self._pool, self._owner = holders, owner
        now = time.monotonic()
        for block_hash in self._held:
            holders.hold(block_hash, owner)
        for block_hash, until in self._pending.items():
            if until > now and block_hash not in self._held:
                holders.hold(block_hash, owner, until)

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._held:
            return True
        until = self._pending.get(block_hash)  # type: ignore[call-overload]
        return until is not None and until > time.monotonic()

    def cached_tokens(self, prompt: PromptBlocks, block_size: int) -> int:
        """Leading prompt tokens the engine holds (its block size, from its stats): a
        binary search over the prompt's blocks, as ``PrefixHolders.deepest`` searches,
        since what an engine holds of one chain is a prefix of it (vLLM frees a
        request's blocks tail first, so it evicts them tail first)."""
        hashes = prompt.hashes(block_size)
        low, high = 0, len(hashes)  # held at blocks < low; not at blocks >= high
        while low < high:
            middle = (low + high) // 2
            if hashes[middle] in self:
                low = middle + 1
            else:
                high = middle
        return prompt.cacheable_tokens(block_size, low) if low else 0

    def expect(self, prompt: PromptBlocks, block_size: int) -> None:
        """The prompt was sent to this engine: its blocks are about to be stored."""
        if self._pending_s <= 0:
            return
        now = time.monotonic()
        until = now + self._pending_s
        if len(self._pending) > len(self._held) + PENDING_SWEEP_SLACK:
            self._sweep(now)
        pool = self._pool
        for block_hash in prompt.hashes(block_size):
            if block_hash not in self._held:
                self._pending[block_hash] = until
                if pool is not None:
                    pool.hold(block_hash, self._owner, until)

    def _sweep(self, now: float) -> None:
        expired = [h for h, until in self._pending.items() if until <= now]
        for block_hash in expired:
            del self._pending[block_hash]
            if self._pool is not None and block_hash not in self._held:
                self._pool.release(block_hash, self._owner)

    def forget(self) -> None:
        """Nothing is known of this engine's cache any more (its stream broke)."""
        if self._pool is not None:
            for block_hash in {*self._held, *self._pending}:
                self._pool.release(block_hash, self._owner)
        self._names.clear()
        self._held.clear()
        self._pending.clear()

    def apply(self, update: CacheUpdate) -> None:
        """Idempotent per block: a snapshot may repeat changes that crossed it."""
        # Per block, for every engine's events: the offline simulation's hottest loop.
        names, held, forget = self._names, self._held, self._pending.pop
        pool, owner = self._pool, self._owner
        if update.cleared:
            if pool is not None:
                for block_hash in held:
                    if block_hash not in self._pending:
                        pool.release(block_hash, owner)
            names.clear()
            held.clear()
        for vllm_hash, ours in update.stored:
            forget(ours, None)
            if vllm_hash not in names:
                names[vllm_hash] = ours
                count = held.get(ours, 0)
                held[ours] = count + 1
                if pool is not None and not count:
                    pool.hold(ours, owner)
        for vllm_hash in update.removed:
            removed = names.pop(vllm_hash, None)
            if removed is not None:
                forget(removed, None)
                left = held.get(removed, 0) - 1
                if left > 0:
                    held[removed] = left
                else:
                    held.pop(removed, None)
                    if pool is not None:
                        pool.release(removed, owner)


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
