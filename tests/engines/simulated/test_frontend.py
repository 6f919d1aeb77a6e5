"""The simulated front end: one thread of input processing, and what it has taken in
reaches the scheduler together once it has nothing left to take in."""

from __future__ import annotations

import pytest

from engines.simulated.frontend import FrontEnd
from engines.simulated.scheduler import SimRequest


def _request(name: str) -> SimRequest:
    return SimRequest(name, prompt_tokens=8, max_tokens=4)


def test_a_lone_request_reaches_the_scheduler_after_its_own_intake() -> None:
    front_end = FrontEnd(0.003)
    due = front_end.take(_request("a"), now=1.0)
    assert due == pytest.approx(1.003)
    assert [r.request_id for r in front_end.release(due)] == ["a"]


def test_a_burst_reaches_the_scheduler_together_after_all_its_intakes() -> None:
    front_end = FrontEnd(0.003)
    dues = [front_end.take(_request(name), now=0.0) for name in "abcd"]
    assert dues == pytest.approx([0.003, 0.006, 0.009, 0.012])
    # Each earlier time finds more taken in since: nothing is released before the last.
    assert all(front_end.release(due) == [] for due in dues[:-1])
    assert [r.request_id for r in front_end.release(dues[-1])] == list("abcd")


def test_requests_apart_in_time_are_released_one_by_one() -> None:
    front_end = FrontEnd(0.003)
    first = front_end.take(_request("a"), now=0.0)
    assert [r.request_id for r in front_end.release(first)] == ["a"]
    second = front_end.take(_request("b"), now=0.5)  # the thread was idle: no queue
    assert second == pytest.approx(0.503)
    assert [r.request_id for r in front_end.release(second)] == ["b"]


def test_an_aborted_request_never_reaches_the_scheduler() -> None:
    front_end = FrontEnd(0.003)
    front_end.take(_request("a"), now=0.0)
    due = front_end.take(_request("b"), now=0.0)
    assert front_end.drop("a") and not front_end.drop("a")
    assert [r.request_id for r in front_end.release(due)] == ["b"]


def test_kv_that_arrives_for_a_request_still_held_is_marked_for_the_scheduler() -> None:
    front_end = FrontEnd(0.003)
    held = _request("a")
    due = front_end.take(held, now=0.0)
    front_end.take(_request("b"), now=0.0)
    assert front_end.kv_arrived("a") and held.kv_ready
    assert not front_end.kv_arrived("elsewhere")  # not held: the scheduler's to mark
    assert front_end.release(due) == []
