"""vLLM's scheduling, without a model: budgets, chunked prefill, the prefix cache and its
events, preemption, priority and handed-over KV."""

from __future__ import annotations

from engines.kv_events import chain_hashes
from engines.simulated.scheduler import SimRequest, SimScheduler
from tests.support.simulated import BLOCK
from tests.support.simulated import small_scheduler as _scheduler


def _request(name: str, prompt: int, out: int = 4, **fields: object) -> SimRequest:
    tokens = list(range(prompt))
    return SimRequest(name, prompt, out, block_hashes=chain_hashes(tokens, BLOCK), **fields)  # type: ignore[arg-type]


def _run(scheduler: SimScheduler, steps: int = 1000) -> list[list[tuple[str, int]]]:
    """Every step's (request, tokens) until nothing is left."""
    trace = []
    for _ in range(steps):
        step = scheduler.schedule()
        if step is None:
            break
        trace.append([(r.request_id, t) for r, t in step.work])
        scheduler.complete(step)
    return trace


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    scheduler.add(_request("a", 40, out=2))
    trace = _run(scheduler)
    assert trace == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)]]


def test_decodes_are_scheduled_before_a_new_prefill_takes_the_rest_of_the_budget() -> None:
    scheduler = _scheduler(max_num_batched_tokens=16)
    scheduler.add(_request("a", 8, out=3))
    step = scheduler.schedule()
    assert step is not None
    scheduler.complete(step)
    scheduler.add(_request("b", 40))
    step = scheduler.schedule()
    assert step is not None
    assert [(r.request_id, t) for r, t in step.work] == [("a", 1), ("b", 15)]
    assert step.shape.decode_seqs == 1
    assert step.shape.prefill_tokens == 15
    assert step.shape.decode_context_tokens == 9


def test_max_num_seqs_caps_the_batch() -> None:
    scheduler = _scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(_request(name, 4, out=2))
    step = scheduler.schedule()
    assert step is not None
    assert [r.request_id for r, _ in step.work] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_a_repeated_prompt_hits_the_prefix_cache_and_its_blocks_are_published() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 17, out=1))
    _run(scheduler)
    events = scheduler.blocks.take_events()
    assert events.stored == chain_hashes(list(range(17)), BLOCK)
    scheduler.add(_request("b", 17, out=1))
    trace = _run(scheduler)
    assert trace == [[("b", 1)]]  # 16 of 17 tokens were cached
    assert scheduler.prefix_hits == 16
    assert scheduler.prefix_queries == 34


def test_a_whole_prompt_hit_still_computes_its_last_block() -> None:
    scheduler = _scheduler()
    scheduler.add(_request("a", 16, out=1))
    _run(scheduler)
    scheduler.add(_request("b", 16, out=1))
    assert _run(scheduler) == [[("b", 4)]]


def test_freed_blocks_are_evicted_oldest_first_and_evictions_are_published() -> None:
    scheduler = _scheduler(num_blocks=8)
    scheduler.add(_request("a", 16, out=1))
    _run(scheduler)
    first = scheduler.blocks.take_events().stored
    other = list(range(100, 132))  # 8 blocks of other tokens: every cached one must go
    scheduler.add(SimRequest("b", 32, 1, block_hashes=chain_hashes(other, BLOCK)))
    _run(scheduler)
    events = scheduler.blocks.take_events()
    assert sorted(events.removed) == sorted(first)
    # The tail of a's prompt was freed first, so it went first.
    assert events.removed[0] == first[-1]


def test_running_out_of_blocks_preempts_the_newest_request_which_recomputes() -> None:
    scheduler = _scheduler(num_blocks=6, max_num_batched_tokens=64)
    scheduler.add(_request("a", 8, out=8))  # 16 tokens: 4 blocks in the end
    scheduler.add(_request("b", 8, out=8))
    trace = _run(scheduler)
    assert scheduler.preemptions >= 1
    assert sum(t for step in trace for name, t in step if name == "a") == 8 + 7
    # b gave its blocks back and computed its prompt and what it had output again.
    assert sum(t for step in trace for name, t in step if name == "b") > 8 + 7
    assert len(scheduler) == 0
    assert scheduler.blocks.free_blocks == 6


def test_the_priority_policy_admits_the_most_urgent_first_and_preempts_the_least() -> None:
    scheduler = _scheduler(policy="priority", max_num_seqs=1)
    scheduler.add(_request("low", 4, out=1, priority=5, arrival=0.0))
    scheduler.add(_request("high", 4, out=1, priority=0, arrival=1.0))
    trace = _run(scheduler)
    assert [step[0][0] for step in trace] == ["high", "low"]


def test_handed_over_kv_waits_then_computes_only_the_last_prompt_token() -> None:
    scheduler = _scheduler(kv_load_steps=0)
    request = _request("d", 20, out=2, kv_from_elsewhere=True, kv_ready=False)
    scheduler.add(request)
    assert scheduler.schedule() is None
    scheduler.kv_arrived("d")
    assert _run(scheduler) == [[("d", 1)], [("d", 1)]]
    assert request.cached_tokens == 19


def test_handed_over_kv_is_loaded_in_a_step_before_the_one_that_computes() -> None:
    """vLLM learns that an asynchronous load is done from a step's output: the request
    computes in the step after, and an idle engine runs a step for the load alone."""
    scheduler = _scheduler()  # one load step, as for ours and NIXL's connector
    request = _request("d", 20, out=2, kv_from_elsewhere=True, kv_ready=False)
    scheduler.add(request)
    assert scheduler.schedule() is None  # its KV has not arrived: nothing to load yet
    scheduler.kv_arrived("d")
    load = scheduler.schedule()
    assert load is not None and load.work == [] and load.loads == [request]
    assert load.shape.kv_loads == 1 and load.shape.tokens == 0
    scheduler.complete(load)
    assert _run(scheduler) == [[("d", 1)], [("d", 1)]]


def test_a_load_rides_along_a_busy_engines_step_and_holds_no_decode_run() -> None:
    scheduler = _scheduler(kv_load_steps=2)
    scheduler.add(_request("busy", 4, out=20))
    prompt = scheduler.schedule()  # its prompt
    assert prompt is not None
    scheduler.complete(prompt)
    scheduler.add(_request("d", 20, out=1, kv_from_elsewhere=True))
    steps = []
    for _ in range(3):
        step = scheduler.schedule()
        assert step is not None
        # A step that loads is never stretched into a run of decodes.
        assert scheduler.decode_run_length(step) == 1
        steps.append(sorted(r.request_id for r, _ in step.work))
        scheduler.complete(step)
    assert steps == [["busy"], ["busy"], ["busy", "d"]]


def test_an_aborted_request_gives_its_blocks_back() -> None:
    scheduler = _scheduler(num_blocks=16)
    scheduler.add(_request("a", 30, out=4))
    step = scheduler.schedule()
    assert step is not None
    scheduler.complete(step)
    assert scheduler.blocks.free_blocks < 16
    scheduler.abort("a")
    assert scheduler.blocks.free_blocks == 16
    assert scheduler.schedule() is None


def test_a_request_larger_than_the_cache_is_refused() -> None:
    scheduler = _scheduler(num_blocks=4)
    try:
        scheduler.add(_request("a", 30))
    except ValueError as error:
        assert "KV blocks" in str(error)
    else:
        raise AssertionError("a request the cache cannot hold was accepted")
