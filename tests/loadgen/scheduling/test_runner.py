"""The runner's own arithmetic, without a server."""

from __future__ import annotations

from loadgen.client.streaming import RequestRecord
from loadgen.scheduling.runner import unscale


def test_a_run_against_slowed_engines_is_reported_in_their_own_time() -> None:
    record = RequestRecord(index=0, input_len=1, output_len=2)
    record.scheduled_at, record.sent_at, record.done_at = 100.0, 110.0, 140.0
    record.chunk_times = [120.0, 140.0]
    record.event_times = [120.0, 140.0]
    unscale(record, run_start=100.0, scale=10.0)
    assert (record.scheduled_at, record.sent_at, record.done_at) == (100.0, 101.0, 104.0)
    assert record.chunk_times == [102.0, 104.0]
    assert record.event_times == [102.0, 104.0]
