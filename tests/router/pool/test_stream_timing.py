"""StreamTiming: what a request's token stream tells its engine's state, read chunk by
chunk (the router's stream) or a run at a time (the offline simulation), the same."""

from __future__ import annotations

import pytest

from router.pool.engine_state import EngineState

# A prefill of 256 tokens, then steps of 10 ms, then a multi-step group of four at once.
TIMES = [0.300, 0.310, 0.320, 0.330, 0.370, 0.370, 0.370, 0.370, 0.380]


def _chunks(times: list[float]) -> list[tuple[float, int]]:
    """The chunks a router reads: the tokens of one time together."""
    chunks: list[tuple[float, int]] = []
    for at in times:
        if chunks and chunks[-1][0] == at:
            chunks[-1] = (at, chunks[-1][1] + 1)
        else:
            chunks.append((at, 1))
    return chunks


def _state() -> EngineState:
    return EngineState(ema_weight=0.2, min_prefill_tokens_per_sample=64)


def test_the_first_token_samples_the_prefill_and_later_chunks_the_step() -> None:
    state = _state()
    timing = state.open_stream(256, now=0.0)
    assert state.queued_prefills == 1
    timing.tokens(0.256, 1, finished=False)
    assert state.queued_prefills == 0
    assert state.prefill_s_per_token.value == pytest.approx(0.001)
    timing.tokens(0.296, 4, finished=False)  # a group of four tokens in one chunk
    assert state.step_s.value == pytest.approx(0.010)


def test_a_whole_answer_in_one_chunk_is_no_first_token_sample() -> None:
    state = _state()
    timing = state.open_stream(256, now=0.0)
    timing.tokens(2.0, 16, finished=True)
    assert state.prefill_s_per_token.value is None and state.queued_prefills == 0


# Runs end between steps (a multi-step group is never split).
@pytest.mark.parametrize("split", [1, 3, 4, 8, len(TIMES)])
def test_runs_of_tokens_read_as_their_chunks_do(split: int) -> None:
    by_chunk, by_run = _state(), _state()
    chunked = by_chunk.open_stream(256, now=0.0)
    for index, (at, count) in enumerate(chunks := _chunks(TIMES)):
        chunked.tokens(at, count, finished=index == len(chunks) - 1)
    run = by_run.open_stream(256, now=0.0)
    run.run_tokens(TIMES[:split], finished=False)
    if TIMES[split:]:
        run.run_tokens(TIMES[split:], finished=True)
    assert by_run.prefill_s_per_token.value == by_chunk.prefill_s_per_token.value
    assert by_run.step_s.value == pytest.approx(by_chunk.step_s.value, rel=1e-12)
    assert run.last_token_at == chunked.last_token_at == TIMES[-1]
