"""A content-free record of the traffic the router served, for the shape advisor.

One JSON line per request that got an answer: when it arrived (seconds from the start
of the record), its prompt and output lengths in tokens, its priority, and the chained
hashes of its prompt's full blocks of ``block_tokens`` tokens, salted with a key that
never leaves this process: two requests that share a prefix share its hashes, and
nothing else can be learned from them. Never text, never token ids.
``python -m loadgen --trace recorded --trace-file FILE`` replays it, prefix reuse
included (loadgen/data/recorded.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from router.pool.prefix_index import PromptBlocks

RECORD_VERSION = 1
HASH_BYTES = 8


class TrafficRecorder:
    def __init__(self, path: Path | str, block_tokens: int) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._block_tokens = block_tokens
        self._salt = os.urandom(16)
        self._start = time.perf_counter()
        # Line-buffered: a record survives the router being killed.
        self._file = self._path.open("a", buffering=1)
        header = {"version": RECORD_VERSION, "block_tokens": block_tokens, "started": time.time()}
        self._file.write(json.dumps({"header": header}) + "\n")

    def record(
        self, arrival: float, prompt_token_ids: Sequence[int], output_tokens: int, priority: str
    ) -> None:
        """``arrival``: the request's ``perf_counter()`` when it came in."""
        blocks = PromptBlocks(prompt_token_ids).hashes(self._block_tokens)
        line = {
            "t": round(arrival - self._start, 6),
            "in": len(prompt_token_ids),
            "out": output_tokens,
            "priority": priority,
            "prefix": [self._salted(block) for block in blocks],
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()

    def _salted(self, block_hash: int) -> str:
        digest = hashlib.blake2b(
            block_hash.to_bytes(16, "big", signed=True), key=self._salt, digest_size=HASH_BYTES
        )
        return digest.hexdigest()
