"""The router's estimate of what each engine replica holds in its prefix cache.

vLLM caches KV per full block and finds a prompt's cached prefix by chaining block
hashes, each over its parent's hash and its own tokens. The router mirrors that: it
records the chained hashes of every prompt it sends to a replica and, for a new prompt,
counts the leading blocks a replica has seen. The mirror is bounded by the replica's KV
capacity and forgets least recently used blocks first, as vLLM's free-block queue does;
it cannot see evictions forced by other traffic, so it is an estimate, checked against
the ``num_cached_tokens`` vLLM reports (``splitserve_prefix_cache_tokens_total``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# Any fixed value: the parent of a prompt's first block.
ROOT_HASH = 0


class PromptBlocks:
    """A prompt's chained block hashes, computed once per block size however many
    replicas are asked about it."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            chain, parent = [], ROOT_HASH
            for start in range(0, len(self.token_ids) - block_size + 1, block_size):
                parent = hash((parent, tuple(self.token_ids[start : start + block_size])))
                chain.append(parent)
            self._hashes[block_size] = chain
        return self._hashes[block_size]

    def cacheable_tokens(self, block_size: int, hit_blocks: int) -> int:
        # vLLM recomputes at least the last prompt token to get its logits, so a full hit
        # is worth one block less when the prompt ends on a block boundary.
        return min(hit_blocks * block_size, (len(self.token_ids) - 1) // block_size * block_size)


class PrefixIndex:
    """One replica's cached blocks as the router believes them, least recently used first."""

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("a prefix index needs a block size and a capacity of at least 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        """Leading prompt tokens this replica should find in its prefix cache."""
        hits = 0
        for block_hash in prompt.hashes(self.block_size):
            if block_hash not in self._blocks:
                break
            hits += 1
        return prompt.cacheable_tokens(self.block_size, hits) if hits else 0

    def record(self, prompt: PromptBlocks) -> None:
        """The replica computed (or loaded) this prompt: its full blocks are now cached."""
        for block_hash in prompt.hashes(self.block_size):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
