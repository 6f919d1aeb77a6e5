"""vLLM's result format from one of our runs, without vLLM: failures, labels, figures."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.client.streaming import RequestRecord
from loadgen.config import RampUpConfig, RunConfig, WorkloadConfig
from loadgen.outputs.stats import chunk_times
from loadgen.scheduling.runner import RunResult, execute_run
from loadgen.vllm_compat.result import (
    VllmResultOptions,
    percentile_word,
    save_vllm_result,
    vllm_result,
    write_vllm_result,
)

QUIET = Console(quiet=True)


def run(**fields: object) -> RunResult:
    config = {
        "workload": WorkloadConfig(name="custom", input_len=16, output_len=6),
        "qps": 200.0,
        "num_requests": 14,
        "warmup_requests": 1,
        "show_progress": False,
        "server_metrics": False,
        **fields,
    }
    server = FakeServerConfig(port=0, ttft_ms=1, itl_ms=0.5, tokens_per_chunk=2, reject_every=5)
    with fake_server_in_thread(server) as url:
        run_config = RunConfig.model_validate({"base_url": url, **config})
        return asyncio.run(execute_run(run_config, QUIET))


@pytest.fixture(scope="module")
def result() -> Iterator[RunResult]:
    yield run(slo_ttft_ms=1000, slo_e2el_ms=1000, max_concurrency=3)


def test_failures_in_vllms_terms(result: RunResult) -> None:
    document = vllm_result(result)
    failed = [i for i, error in enumerate(document["errors"]) if error]
    assert document["failed"] == len(failed) > 0
    assert document["completed"] + document["failed"] == document["num_prompts"] == 14
    for index in failed:
        assert document["ttfts"][index] == 0.0 and document["itls"][index] == []
        assert document["output_lens"][index] == 0 and document["latencies"][index] == 0.0
    done = [i for i in range(14) if i not in failed]
    # Six tokens in chunks of two: two ITL gaps (vLLM's), five per-token gaps (ours).
    assert {len(document["itls"][i]) for i in done} == {2}
    assert {len(document["splitserve_itls_per_token"][i]) for i in done} == {5}
    assert document["total_output_tokens"] == 6 * len(done)
    assert document["request_goodput"] == pytest.approx(document["request_throughput"])
    # With --max-concurrency, vLLM's queue-time figures exist (and are asked for here).
    options = VllmResultOptions(percentile_metrics=("client_queue_time",), percentiles=(99.9,))
    figures = vllm_result(result, options)
    assert "p99.9_client_queue_time_ms" in figures and "mean_ttft_ms" not in figures


def test_our_file_carries_the_mode_and_every_list(result: RunResult, tmp_path: Path) -> None:
    document = json.loads(write_vllm_result(result, tmp_path).read_text())
    assert document["label"] == result.shape and len(document["start_times"]) == 14
    assert {"p50_itl_ms", "p95_e2el_ms", "splitserve_p99_itl_per_token_ms"} <= set(document)


def test_save_and_append_as_vllm(result: RunResult, tmp_path: Path) -> None:
    options = VllmResultOptions(label="mine", metadata={"tp": "2"}, detailed=False)
    first = save_vllm_result(result, options, tmp_path)
    assert first.name.startswith("mine-200.0qps-concurrency3-fake-model-")
    for _ in range(2):
        save_vllm_result(result, options, tmp_path, "runs.json", append=True)
    lines = (tmp_path / "runs.json").read_text().splitlines()
    assert [json.loads(line)["tp"] for line in lines] == ["2", "2"]
    assert "ttfts" not in json.loads(lines[0]) and "latencies" in json.loads(lines[0])


def test_ramp_up_writes_its_rates_and_events() -> None:
    ramp = RampUpConfig(strategy="linear", start_rps=100, end_rps=400)
    document = vllm_result(run(ramp_up=ramp, qps=math.inf))
    assert (document["ramp_up_start_rps"], document["ramp_up_end_rps"]) == (100, 400)
    assert document["request_rate"] == "inf" and document["request_goodput"] is None
    events = document["rps_change_events"]
    assert [e["rps"] for e in events] == list(range(100, 401))


def test_chunk_times_put_one_gap_per_chunk() -> None:
    record = RequestRecord(index=0, input_len=1, output_len=5, sent_at=10.0)
    record.event_times, record.event_counts = [10.5, 10.7, 11.0], [2, 1, 2]
    chunks = chunk_times(record)
    assert chunks is not None
    assert chunks.ttft_s == 0.5 and chunks.latency_s == 1.0
    assert chunks.itl_s == pytest.approx((0.0, 0.2, 0.3, 0.0))


def test_percentile_words() -> None:
    assert [percentile_word(p) for p in (50, 99.0, 99.9)] == ["50", "99", "99.9"]
