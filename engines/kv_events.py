"""An engine's prefix cache as it is, not as the router guesses it: vLLM's KV events.

With ``router.prefix_signal: kv_events`` every vLLM engine publishes BlockStored,
BlockRemoved and AllBlocksCleared (vLLM's ``kv_events_config``) on an ipc socket in a
private folder: the events carry prompt token ids, so they never go on a network port.
The engine's host subscribes, names each stored block by the router's chained prefix
hash over token ids (``chain_hash``), and sends every router the changes as
``CacheUpdate`` items on its delta stream, a whole snapshot first; the router keeps
each engine's exact block set from them (router/pool/prefix_index.py ``BlockIndex``).

A batch lost between engine and host (a gap in vLLM's sequence numbers) clears the
set: the router then underestimates until blocks are stored again, and never counts
blocks that may be gone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from engines.protocol import CacheUpdate
from engines.socket_folders import owned_folder, remove_folder

logger = logging.getLogger("splitserve.engines")

# The parent of a prompt's first block, in the router's chain of block hashes.
ROOT_HASH = 0
# How long the subscriber thread waits for a batch before it looks whether to stop.
POLL_MS = 200


def chain_hash(parent: int, block_token_ids: Sequence[int]) -> int:
    """The router's hash of one full block: its parent's hash and its own token ids.
    Python hashes ints and tuples of ints the same in every process (no hash seed)."""
    return hash((parent, tuple(block_token_ids)))


def chain_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The router's chained hash of each full block of a prompt, in order: ``chain_hash``
    of each block, inlined over one tuple of the prompt (a decision hashes every prompt
    it routes, and the calls and list-to-tuple copies were most of the cost)."""
    tokens = tuple(token_ids)
    chain: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tokens[start : start + block_size]))
        chain.append(parent)
    return chain


class BlockNames:
    """vLLM's hash of each cached block → the router's chained hash of the same block."""

    def __init__(self) -> None:
        self._names: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self._names)

    def apply(self, event: Any) -> CacheUpdate | None:
        """What one vLLM KV event changes, as the router needs it; None for nothing."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            removed = [h for h in event.block_hashes if self._names.pop(h, None) is not None]
            return CacheUpdate(removed=removed) if removed else None
        if isinstance(event, AllBlocksCleared):
            return self.clear()
        return None

    def clear(self) -> CacheUpdate:
        self._names.clear()
        return CacheUpdate(cleared=True)

    def snapshot(self) -> CacheUpdate:
        return CacheUpdate(stored=list(self._names.items()), cleared=True)

    def _stored(self, event: Any) -> CacheUpdate | None:
        if event.group_idx not in (None, 0):
            return None  # another KV cache group (hybrid models): not a prompt prefix
        if event.parent_block_hash is None:
            parent: int | None = ROOT_HASH
        else:
            parent = self._names.get(event.parent_block_hash)
        size = event.block_size
        stored = []
        for index, vllm_hash in enumerate(event.block_hashes):
            extra = event.extra_keys[index] if event.extra_keys else None
            if parent is None or extra:
                # A missed parent, or a block keyed by more than its tokens (LoRA,
                # images, a cache salt): no plain prompt can find it, nor its children.
                break
            parent = chain_hash(parent, event.token_ids[index * size : (index + 1) * size])
            self._names[vllm_hash] = parent
            stored.append((vllm_hash, parent))
        return CacheUpdate(stored=stored) if stored else None


class KVEventRelay:
    """Subscribes to one engine's KV events and hands each change to ``deliver``
    (called from its own thread), keeping the names a snapshot is made of."""

    def __init__(self, engine_name: str, deliver: Callable[[CacheUpdate], None]) -> None:
        self._folder = owned_folder("kv-events")
        self.endpoint = f"ipc://{self._folder / engine_name}.sock"
        self._deliver = deliver
        self._names = BlockNames()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-{engine_name}", daemon=True
        )

    def events_config(self) -> Any:
        """vLLM's ``kv_events_config`` that makes the engine publish to this relay."""
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint)

    def start(self) -> None:
        """Before the engine starts: a subscriber may connect before the publisher binds."""
        self._thread.start()

    def snapshot(self) -> CacheUpdate:
        with self._lock:
            return self._names.snapshot()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_MS / 1000)
        remove_folder(self._folder)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        expected: int | None = None
        try:
            while not self._stopping.is_set():
                if not socket.poll(POLL_MS):
                    continue
                _topic, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if expected is not None and seq != expected:
                    logger.warning("lost KV events %d-%d; the prefix index restarts", expected, seq)
                    self._forget_all()
                expected = seq + 1
                events = decoder.decode(payload).events
                with self._lock:
                    updates = [self._names.apply(event) for event in events]
                self._deliver_all(updates)
        except Exception:  # the router falls back to underestimating, never to wrong hits
            logger.exception("KV event relay stopped")
            with contextlib.suppress(Exception):
                self._forget_all()
        finally:
            socket.close(linger=0)

    def _forget_all(self) -> None:
        """The names no longer match the engine's cache: routers start over from nothing."""
        with self._lock:
            cleared = self._names.clear()
        self._deliver(cleared)

    def _deliver_all(self, updates: list[CacheUpdate | None]) -> None:
        for update in updates:
            if update is not None:
                self._deliver(update)
