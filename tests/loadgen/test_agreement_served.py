"""End to end against the real ``single.yaml``: our load generator counts what the server
served, and measures the latencies vLLM's own benchmark client (``vllm bench serve``)
measures on the same workload, both clients at once.

The workload, the pinning of clients and server to separate cores, and the time-local
comparison are bench/client_agreement.py's, where each design choice is measured. That
benchmark runs 300 requests a client and holds the median of its repeats to 10% for
TTFT and ITL; this test runs 80, which is enough for ITL (its time-local ratio stayed
within 3% in every run) and not for TTFT (a bootstrap spread of +-6-12% at this size,
and single repeats of the benchmark up to 17% apart), so TTFT gets 50% here.

Why not tighter: the two spreads add, so a true ratio of 1.0 reads anywhere in about
0.75-1.25 at 80 requests, and a CI run on a busy box read 1.309 (whole-run p50s 78 and
63 ms) with ITL at 1.039; 300 requests (the benchmark's size, which holds 10% at the
median of its repeats) would add about five minutes to the suite. What the test is
for still fails at 50%: a client that stamps the first token at a later event is off
several-fold on this 512 -> 64 workload (a TTFT of about 25 ms against 63 more tokens
at about 3 ms each, ../shared/ENVIRONMENT.md's bare-vLLM figures).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.client_agreement import (
    INPUT_LEN,
    ITL_TOLERANCE,
    OUTPUT_LEN,
    compare,
    has_a_core_for_the_clients,
    run_both_clients,
)
from deployments.launcher import RunningApp

pytestmark = pytest.mark.serving

REQUESTS = 80  # per client: about 110 s at the benchmark's 0.75 req/s
TTFT_TOLERANCE_AT_THIS_SIZE = 0.50


def test_counts_and_latencies_agree_with_vllm_client(
    shapes_app: RunningApp, serve_logs: Path, cluster_pids: Callable[[], set[int]]
) -> None:
    if not has_a_core_for_the_clients():
        pytest.skip("needs two cores: one for the server, one for the clients")
    app = shapes_app  # single.yaml's model: the one its requests name
    run, theirs = run_both_clients(app.base_url, serve_logs / "agreement", REQUESTS, cluster_pids)

    s = run["summary"]
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (REQUESTS,) * 2 + (0, 0)
    assert s["input_tokens"] == REQUESTS * INPUT_LEN  # as the server counted them
    assert s["output_tokens"] == REQUESTS * OUTPUT_LEN
    assert s["length_mismatches"] == 0
    assert s["itl"]["count"] == REQUESTS * (OUTPUT_LEN - 1)
    # Another Serve application on the same port would share the traffic (Serve's
    # proxy binds with SO_REUSEPORT); the router's own shape label catches that.
    assert run["shape"] == "single", f"measured a {run['shape']!r} server, not ours"
    assert run["server"]["requests_by_status"].get("200", 0) >= REQUESTS
    assert theirs["completed"] == REQUESTS and theirs["failed"] == 0

    agreement = compare(run, theirs)
    print(agreement.report())
    assert agreement.ttft_ratio == pytest.approx(1.0, rel=TTFT_TOLERANCE_AT_THIS_SIZE), (
        agreement.report()
    )
    assert agreement.itl_ratio == pytest.approx(1.0, rel=ITL_TOLERANCE), agreement.report()
