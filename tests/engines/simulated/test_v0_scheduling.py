"""vLLM 0.6.0's V0 scheduling, as the simulator replays it: without chunked prefill a step
is whole prompts or decodes, never both; with multi-step scheduling a decode batch runs
a group of steps and hands its tokens back at the group's end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.kv_events import chain_hashes
from engines.protocol import GenerateChunk, GenerateRequest
from engines.simulated.host import SimulatedEngineHost
from engines.simulated.scheduler import SchedulerLimits, SimRequest, SimScheduler
from tests.support.simulated import BLOCK, round_profile, small_scheduler


def _scheduler(**limits: Any) -> SimScheduler:
    """V0 without chunked prefill, unless ``limits`` say otherwise."""
    return small_scheduler(**{"chunked_prefill": False, **limits})


def _request(name: str, prompt: int, out: int = 4, text: str | None = None) -> SimRequest:
    """A request whose prompt is its own (or ``text``'s, for a shared prefix)."""
    first = 1000 * ord(text or name)
    tokens = list(range(first, first + prompt))
    return SimRequest(name, prompt, out, block_hashes=chain_hashes(tokens, BLOCK))


def _work(scheduler: SimScheduler) -> list[tuple[str, int]]:
    """The next step's (request, tokens), run to its end."""
    step = scheduler.schedule()
    assert step is not None
    scheduler.complete(step)
    return [(r.request_id, t) for r, t in step.work]


def test_a_waiting_prompt_makes_the_next_step_prefill_only_and_decodes_pause() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 8, out=3))
    assert _work(scheduler) == [("a", 8)]
    scheduler.add(_request("b", 8, out=3))
    step = scheduler.schedule()
    assert step is not None
    assert [(r.request_id, t) for r, t in step.work] == [("b", 8)]
    assert step.shape.decode_seqs == 0
    scheduler.complete(step)
    assert _work(scheduler) == [("a", 1), ("b", 1)]


def test_a_prompt_is_never_split_and_admission_stops_at_the_first_that_does_not_fit() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    for name, prompt in (("a", 12), ("b", 12), ("c", 2)):
        scheduler.add(_request(name, prompt, out=2))
    # c would fit beside a, but V0 admits first come first served and stops at b.
    assert _work(scheduler) == [("a", 12)]
    assert _work(scheduler) == [("b", 12), ("c", 2)]
    assert _work(scheduler) == [("a", 1), ("b", 1), ("c", 1)]


def test_the_budget_charges_a_cached_prefix_though_only_the_rest_is_computed() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    scheduler.add(_request("a", 9, out=1))
    _work(scheduler)
    scheduler.add(_request("b", 9, out=1, text="a"))
    scheduler.add(_request("c", 9, out=1, text="a"))
    # b computes 1 token past its 8 cached ones, but V0 counts all 9 against the budget.
    assert _work(scheduler) == [("b", 1)]


def test_a_prompt_longer_than_the_budget_is_refused() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="without chunked prefill"):
        scheduler.add(_request("a", 17, out=1))
    # Its output recomputed after a preemption would not fit either.
    with pytest.raises(ValueError, match="without chunked prefill"):
        scheduler.add(_request("b", 12, out=6))


def test_multi_step_needs_chunked_prefill_off() -> None:
    with pytest.raises(ValueError, match="chunked_prefill"):
        SchedulerLimits(1, 16, BLOCK, 16, scheduler_steps=2)


def test_a_decode_group_delivers_its_steps_tokens_at_once_and_a_prefill_one() -> None:
    scheduler = _scheduler(scheduler_steps=4)
    scheduler.add(_request("a", 8, out=9))
    counts = []
    while (step := scheduler.schedule()) is not None:
        counts.append((step.steps, scheduler.complete(step).new_tokens["a"]))
    assert counts == [(1, 1), (4, 4), (4, 4)]


def test_one_that_reaches_max_tokens_mid_group_gets_exactly_them_and_the_batch_runs_on() -> None:
    scheduler = _scheduler(scheduler_steps=4)
    scheduler.add(_request("a", 8, out=3))
    scheduler.add(_request("b", 8, out=10))
    _work(scheduler)
    group = scheduler.schedule()
    assert group is not None and group.steps == 4
    assert group.shape.decode_seqs == 2  # all four steps run both: time is the group's
    result = scheduler.complete(group)
    assert result.new_tokens == {"a": 2, "b": 4}
    assert [r.request_id for r in result.finished] == ["a"]
    assert result.finished[0].output_tokens == 3


def test_a_request_admitted_during_a_group_waits_for_its_end() -> None:
    scheduler = _scheduler(scheduler_steps=4)
    scheduler.add(_request("a", 8, out=9))
    _work(scheduler)
    group = scheduler.schedule()
    assert group is not None
    scheduler.add(_request("b", 8))
    assert "b" not in scheduler.complete(group).new_tokens
    assert _work(scheduler) == [("b", 8)]


def test_a_group_reserves_blocks_for_all_its_steps_up_front() -> None:
    # Two 8-token prompts hold 2 blocks each; 8 steps need 2 more each, and there are 6.
    scheduler = _scheduler(scheduler_steps=8, num_blocks=6)
    scheduler.add(_request("a", 8))
    scheduler.add(_request("b", 8))
    _work(scheduler)
    group = scheduler.schedule()
    assert group is not None
    assert [r.request_id for r, _ in group.work] == ["a"]
    assert [r.request_id for r in group.preempted] == ["b"]
    assert len(group.work[0][0].blocks) == 4


def test_a_run_is_whole_groups_and_ends_as_group_by_group() -> None:
    def started() -> SimScheduler:
        scheduler = _scheduler(scheduler_steps=4)
        scheduler.add(_request("a", 8, out=11))
        scheduler.add(_request("b", 8, out=20))
        _work(scheduler)
        return scheduler

    stepped, run = started(), started()
    while "a" in stepped:
        step = stepped.schedule()
        assert step is not None
        stepped.complete(step)
    group = run.schedule()
    assert group is not None
    assert run.decode_run_length(group) == 12  # a's 10 tokens left, in groups of 4
    with pytest.raises(ValueError, match="cuts a group"):
        run.complete_run(group, 6)
    result = run.complete_run(group, 12)
    assert result.new_tokens == {"a": 10, "b": 12}
    for request in stepped.running:
        (twin,) = [r for r in run.running if r.request_id == request.request_id]
        assert (twin.computed, twin.output_tokens, len(twin.blocks)) == (
            request.computed,
            request.output_tokens,
            len(request.blocks),
        )
    assert run.blocks.free_blocks == stepped.blocks.free_blocks


def _host(tmp_path: Path, steps: int) -> SimulatedEngineHost:
    path = round_profile(tmp_path, 0.02, handover_bytes_per_s=1e9, max_model_len=2048)
    config = parse_app_config(
        {
            "shape": "single",
            "accelerator": "cpu",
            "engine": {"backend": "simulated", "profile": path},
            "pools": [{"engine_kwargs": {"num_scheduler_steps": steps}}],
        }
    )
    ((name, pool, index),) = engine_names(config)
    return SimulatedEngineHost(engine_spec(config, name, pool, index))


async def test_the_real_time_engine_streams_a_groups_tokens_at_its_end(tmp_path: Path) -> None:
    host = _host(tmp_path, steps=3)
    loop = asyncio.get_running_loop()
    params = SimpleNamespace(max_tokens=6, n=1, logprobs=None, prompt_logprobs=None)
    stream = host.deltas("router")
    await host.submit(GenerateRequest("r", "router", list(range(20)), params))
    chunks: list[tuple[float, GenerateChunk]] = []
    try:
        async for batch in stream:
            chunks.extend((loop.time(), c) for _, c in batch if isinstance(c, GenerateChunk))
            if chunks and chunks[-1][1].finish_reason is not None:
                break
    finally:
        host.shutdown()
    assert [len(c.token_ids) for _, c in chunks] == [1, 3, 2]
    # A group's three steps run before any of its tokens is streamed.
    assert chunks[1][0] - chunks[0][0] > 2.5 * 0.02
