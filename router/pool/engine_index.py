"""The pool's engines ordered by what the router decides on, kept as their states change.

Every request's decisions ask the same questions of the pool: which healthy engine of a
role carries the least load, how many prefills wait router-wide, how soon any engine
could start a prompt of a priority, which engines hold a prompt's first blocks. Asked
of every engine per request, they cost what the fleet is large: at 512 engines a scan
per decision was most of a request's routing. Here each engine's answers are filed when
its state changes (its ``EngineState`` marks it dirty; the index refiles the dirty ones
before it answers), in segment trees that give the least in O(1) and take a change in
O(log n), so that a decision costs the same at 2 engines as at 512.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from router.policies.qos import ENGINE_PRIORITY
from router.pool.prefix_index import PrefixHolders, PromptBlocks

if TYPE_CHECKING:
    from router.pool.pooled_engine import PooledEngine

# A key no engine has: an empty or unhealthy slot.
NOWHERE = (math.inf,)
LoadKey = tuple[float, ...]


class MinTree:
    """The least key over a growing set of slots, and the ``k`` least. ``empty``: the key
    of a slot that holds nothing, above every real one (keys compare with it)."""

    def __init__(self, empty: Any = NOWHERE, capacity: int = 8) -> None:
        self._empty = empty
        self._size = 1
        while self._size < capacity:
            self._size *= 2
        self._nodes: list[tuple[Any, int]] = [(empty, -1)] * (2 * self._size)

    def set(self, slot: int, key: Any) -> None:
        if slot >= self._size:
            self._grow(slot + 1)
        nodes, index = self._nodes, slot + self._size
        nodes[index] = (key, slot)
        index //= 2
        while index:
            left, right = nodes[2 * index], nodes[2 * index + 1]
            best = left if left[0] <= right[0] else right
            if nodes[index] == best:
                break  # the rest of the path already holds it
            nodes[index] = best
            index //= 2

    def clear(self, slot: int) -> None:
        if slot < self._size:
            self.set(slot, self._empty)

    def least(self) -> tuple[Any, int] | None:
        """(key, slot) of the least key, or None where every slot is empty."""
        top = self._nodes[1]
        return None if top[0] == self._empty else top

    def smallest(self, k: int) -> list[int]:
        """The slots of the ``k`` least keys, least first: a walk that opens at most k
        subtrees' paths (a heap of the frontier)."""

        frontier = [(self._nodes[1][0], 1)]
        found: list[int] = []
        while frontier and len(found) < k:
            key, index = heapq.heappop(frontier)
            if key == self._empty:
                break
            if index >= self._size:
                found.append(index - self._size)
                continue
            for child in (2 * index, 2 * index + 1):
                heapq.heappush(frontier, (self._nodes[child][0], child))
        return found

    def _grow(self, capacity: int) -> None:
        leaves = [self._nodes[self._size + slot] for slot in range(self._size)]
        self.__init__(self._empty, max(capacity, 2 * self._size))  # type: ignore[misc]
        for slot, (key, _) in enumerate(leaves):
            if key != self._empty:
                self.set(slot, key)


class EngineIndex:
    """One pool's engines, each in a slot of its own, filed by role and by priority."""

    def __init__(self) -> None:
        self._slots: dict[int, PooledEngine] = {}
        self._slot_of: dict[str, int] = {}
        self._free = itertools.count()
        self._dirty: set[int] = set()
        self._roles: dict[str, list[PooledEngine]] = {}
        self._healthy: dict[str, list[PooledEngine]] = {}
        # The least loaded (requests, KV cache use, when last chosen) of each role.
        self._load: dict[str, MinTree] = {}
        # The soonest first token of a prompt of no tokens, by vLLM priority; and how
        # many healthy engines are still unmeasured (then there is no estimate).
        self._soonest = {priority: MinTree(math.inf) for priority in ENGINE_PRIORITY.values()}
        self._unmeasured: set[int] = set()
        self._queued: dict[int, int] = {}
        self._queued_total = 0
        self._chosen = itertools.count(1)
        self._last_chosen: dict[int, int] = {}
        self._health: dict[int, bool] = {}  # as last filed
        # Which engines hold each block (their KV events'), and the engines whose prefix
        # signal is the router's mirror instead (asked one by one: the fallback). Kept
        # only from the first decision that reads it: least-loaded choice and PD's
        # policies never do, and filing every block of every prompt twice was the
        # largest cost of a 64-engine offline run.
        self.prefix = PrefixHolders()
        self._prefix_kept = False
        self._mirror: set[int] = set()
        self._block_sizes: set[int] = set()  # of the engines that send KV events

    # ---- members ------------------------------------------------------------------------

    def add(self, engine: PooledEngine) -> None:
        slot = next(self._free)
        self._slots[slot], self._slot_of[engine.name] = engine, slot
        self._roles.setdefault(engine.role, []).append(engine)
        self._load.setdefault(engine.role, MinTree())
        engine.state.on_change = lambda: self._dirty.add(slot)
        engine.state.owner = slot
        if self._prefix_kept:
            engine.state.keep_holders(self.prefix)
        self._dirty.add(slot)
        self._healthy.pop(engine.role, None)

    def remove(self, engine: PooledEngine) -> None:
        slot = self._slot_of.pop(engine.name)
        del self._slots[slot]
        engine.state.forget_blocks()
        engine.state.on_change = None
        engine.state.holders = None
        self._mirror.discard(slot)
        self._roles[engine.role].remove(engine)
        self._load[engine.role].clear(slot)
        for tree in self._soonest.values():
            tree.clear(slot)
        self._unmeasured.discard(slot)
        self._queued_total -= self._queued.pop(slot, 0)
        self._health.pop(slot, None)
        self._last_chosen.pop(slot, None)
        self._dirty.discard(slot)
        self._healthy.pop(engine.role, None)

    def of_role(self, role: str) -> list[PooledEngine]:
        return self._roles.get(role, [])

    def __iter__(self) -> Iterator[PooledEngine]:
        return iter(list(self._slots.values()))

    # ---- what decisions ask -----------------------------------------------------------

    def healthy(self, role: str) -> list[PooledEngine]:
        """The role's healthy engines, in the order they joined."""
        self.refresh()
        found = self._healthy.get(role)
        if found is None:
            found = self._healthy[role] = [e for e in self.of_role(role) if e.healthy]
        return found

    def least_loaded(self, role: str) -> PooledEngine | None:
        """The healthy engine of ``role`` with the fewest requests (a prefill engine's:
        its queued prefills), then the emptiest KV cache; among equals, the one chosen
        longest ago. None if none is healthy."""
        self.refresh()
        least = self._load[role].least() if role in self._load else None
        if least is None:
            return None
        engine = self._slots[least[1]]
        self._last_chosen[least[1]] = next(self._chosen)
        self._dirty.add(least[1])
        return engine

    def least_requests(self, role: str) -> int | None:
        """The fewest requests a healthy engine of ``role`` carries."""
        self.refresh()
        least = self._load[role].least() if role in self._load else None
        return None if least is None else int(least[0][0])

    def queued_requests(self) -> int:
        """Requests router-wide still waiting for their first token."""
        self.refresh()
        return self._queued_total

    def earliest_ttft_s(self, priority: int) -> float | None:
        """The soonest any healthy engine would start a prompt of vLLM ``priority``:
        the work queued ahead there (a lower bound on any such request's estimate);
        None while a healthy engine is unmeasured."""
        self.refresh()
        if self._unmeasured:
            return None
        least = self._soonest[priority].least()
        return None if least is None else float(least[0])

    def soonest(
        self, priority: int, k: int, among: Callable[[PooledEngine], bool]
    ) -> list[PooledEngine]:
        """Up to ``k`` healthy measured engines that ``among`` admits, soonest to start a
        prompt of ``priority`` first."""
        self.refresh()
        found: list[PooledEngine] = []
        ask = k
        while len(found) < k:
            slots = self._soonest[priority].smallest(ask)
            found = [self._slots[s] for s in slots if among(self._slots[s])][:k]
            if len(slots) < ask:
                break  # every filed engine was seen
            ask *= 2
        return found

    def cached_tokens(self, role: str, prompt: PromptBlocks) -> dict[PooledEngine, int]:
        """The healthy engines of ``role`` that hold the longest leading part of
        ``prompt`` anyone holds, and how many of its tokens (as ``EngineState`` counts
        them: an engine's blocks are prefix-closed); found from the prompt's blocks
        (``PrefixHolders.deepest``), not by asking every engine. Engines whose signal is
        the router's mirror (no KV events yet) are asked one by one."""
        if not self._prefix_kept:
            self._keep_prefix()
        self.refresh()
        found: dict[PooledEngine, int] = {}
        for slot in self._mirror:
            engine = self._slots[slot]
            hits = engine.state.cached_tokens(prompt) if engine.role == role else 0
            if hits and engine.healthy:
                found[engine] = hits
        for size in self._block_sizes:
            depth, holders = self.prefix.deepest(prompt.hashes(size))
            hits = prompt.cacheable_tokens(size, depth)
            for owner in holders:
                holder = self._slots.get(owner) if isinstance(owner, int) else None
                if holder is not None and holder.role == role and holder.healthy:
                    found[holder] = hits
        return found

    def _keep_prefix(self) -> None:
        self._prefix_kept = True
        for engine in self._slots.values():
            engine.state.keep_holders(self.prefix)

    # ---- filing -----------------------------------------------------------------------

    def refresh(self) -> None:
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for slot in dirty:
            engine = self._slots.get(slot)
            if engine is not None:
                self._file(slot, engine)

    def _file(self, slot: int, engine: PooledEngine) -> None:
        state = engine.state
        queued = state.queued_prefills
        self._queued_total += queued - self._queued.get(slot, 0)
        self._queued[slot] = queued
        healthy = engine.healthy
        if self._health.get(slot) is not healthy:
            self._health[slot] = healthy
            self._healthy.pop(engine.role, None)
        load = self._load[engine.role]
        if not healthy:
            load.clear(slot)
            for tree in self._soonest.values():
                tree.clear(slot)
            self._unmeasured.discard(slot)
            return
        if state.prefix_signal == "mirror":
            self._mirror.add(slot)
        else:
            self._mirror.discard(slot)
            self._block_sizes.add(state.block_size)
        requests = state.prefill_queue if engine.role == "prefill" else state.active
        load.set(slot, (requests, state.kv_cache_usage, self._last_chosen.get(slot, 0)))
        if state.prefill_s_per_token.value is None:
            self._unmeasured.add(slot)
            for tree in self._soonest.values():
                tree.clear(slot)
            return
        self._unmeasured.discard(slot)
        for priority, tree in self._soonest.items():
            estimate = state.estimate_ttft_s(0, priority)
            tree.set(slot, estimate if estimate is not None else math.inf)
