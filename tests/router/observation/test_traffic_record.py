"""The router's traffic record round-trips through the load generator: the replay has
the recorded lengths, gaps and prefix sharing, and the record holds no text."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from loadgen.config import WorkloadConfig
from loadgen.data.recorded import PrefixedPrompts, RecordError, read_record
from loadgen.data.workloads import LengthDraws, plan_workload, seed_stream
from router.observation.traffic_record import TrafficRecorder
from router.pool.prefix_index import PromptBlocks

BLOCK = 16
SECRET = [7, 7, 7, 1, 2, 3]  # tokens that must not appear in the record


def _record(path: Path) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(256) for _ in range(3 * BLOCK)]  # a system prompt of 3 blocks
    prompts = [
        shared + [rng.randrange(256) for _ in range(20)],
        shared[:BLOCK] + [rng.randrange(256) for _ in range(40)],  # shares one block
        [rng.randrange(256) for _ in range(10)],  # shorter than a block
        shared + SECRET * 5,
    ]
    recorder = TrafficRecorder(path, BLOCK)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        recorder.record(start + 0.25 * index, prompt, 8 + index, "normal")
    recorder.close()
    return prompts


def test_a_replay_has_the_recorded_lengths_gaps_and_shared_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    prompts = _record(path)
    config = WorkloadConfig(name="recorded-replay", trace="recorded", trace_file=path)
    plan = plan_workload(config, 10, 0, seed=3, max_model_len=4096)
    assert [s.input_len for s in plan.sizes] == [len(p) for p in prompts]
    assert [s.output_len for s in plan.sizes] == [8, 9, 10, 11]
    assert plan.trace_arrivals == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=1e-3)
    replay = PrefixedPrompts(seed=3, block_tokens=BLOCK, low=0, high=256)
    replayed = [replay.prompt(size) for size in plan.sizes]
    assert [len(p) for p in replayed] == [len(p) for p in prompts]

    def sharing(batch: list[list[int]]) -> list[list[int]]:
        """For each pair of prompts, how many leading blocks they share."""
        hashes = [PromptBlocks(p).hashes(BLOCK) for p in batch]
        return [[sum(1 for x, y in zip(a, b, strict=False) if x == y) for b in hashes]
                for a in hashes]  # fmt: skip

    assert sharing(replayed) == sharing(prompts)


def test_the_record_holds_lengths_and_salted_hashes_only(tmp_path: Path) -> None:
    path = tmp_path / "traffic.jsonl"
    prompts = _record(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(lines[0]) == {"header"}
    for line in lines[1:]:
        assert set(line) == {"t", "in", "out", "priority", "prefix"}
        assert all(len(h) == 16 and int(h, 16) >= 0 for h in line["prefix"])
    text = path.read_text()
    assert str(SECRET)[1:-1] not in text and json.dumps(prompts[3]) not in text
    # Another recording of the same prompts hashes them differently (a fresh salt).
    again = tmp_path / "again.jsonl"
    _record(again)
    first = json.loads(path.read_text().splitlines()[1])["prefix"]
    second = json.loads(again.read_text().splitlines()[1])["prefix"]
    assert first != second


def test_not_a_record_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    path.write_text('{"t": 0}\n')
    with pytest.raises(RecordError, match="no header"):
        read_record(path)
    config = WorkloadConfig(name="recorded-replay", trace="recorded")
    draws = LengthDraws(1, 0, seed_stream(0, 0), seed_stream(0, 1), 4096)
    from loadgen.data.recorded import RecordedReplay

    with pytest.raises(RecordError, match="--trace-file"):
        RecordedReplay().plan(config, draws)
