"""End to end against the real ``single.yaml``: counts, and the same latencies as vLLM's
own benchmark client (``vllm.benchmarks.serve``) on the same workload.

Same workload for both clients: 256 prompt tokens, 32 output tokens with ignore_eos,
greedy, and the same schedule, one request every 0.5 s (2 req/s, a rate one CPU engine
sustains; vLLM's ``--burstiness inf``, our constant arrivals), so neither client draws
a luckier Poisson sample. 40 requests each, back to back in four interleaved rounds of
10 (ours, vLLM's, ours, ...) so that a slow minute on a shared machine hits both;
medians of the pooled samples must agree within 10%.
"""

from __future__ import annotations

import asyncio
import io
import json
import statistics
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from deployments.launcher import serve_run
from deployments.tiny_model import embedded_model_path
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.report import jsonable, write_run_json
from loadgen.runner import RunResult, execute_run

pytestmark = pytest.mark.serving

INPUT_LEN, OUTPUT_LEN = 256, 32
RATE = 2.0
REQUESTS_PER_ROUND = 20
ROUNDS = 4
WARMUPS = 2
TOLERANCE = 0.10


def ours(base_url: str, seed: int) -> RunResult:
    config = RunConfig(
        base_url=base_url,
        workload=WorkloadConfig(name="custom", input_len=INPUT_LEN, output_len=OUTPUT_LEN),
        qps=RATE,
        arrival_process="constant",
        num_requests=REQUESTS_PER_ROUND,
        warmup_requests=WARMUPS,
        seed=seed,
        show_progress=False,
    )
    return asyncio.run(execute_run(config, Console(quiet=True)))


def vllms(base_url: str, model: str, seed: int) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(embedded_model_path()),
            "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--temperature", "0",
            "--request-rate", str(RATE), "--burstiness", "inf",
            "--num-prompts", str(REQUESTS_PER_ROUND),
            "--num-warmups", str(WARMUPS), "--seed", str(seed), "--disable-tqdm",
            "--save-detailed",
        ]
    )  # fmt: skip
    with redirect_stdout(io.StringIO()):
        return main(args)


def test_counts_and_latencies_agree_with_vllm_client(ray_address: str, serve_logs: Path) -> None:
    our_runs: list[RunResult] = []
    their_runs: list[dict[str, Any]] = []
    with serve_run("single", ray_address=ray_address, log_dir=serve_logs) as app:
        model = ours(app.base_url, seed=ROUNDS).model  # also warms the engine for both
        for round_index in range(ROUNDS):
            # Alternate who goes first, so neither client always meets the warmer server.
            if round_index % 2 == 0:
                our_runs.append(ours(app.base_url, seed=round_index))
                their_runs.append(vllms(app.base_url, model, seed=round_index))
            else:
                their_runs.append(vllms(app.base_url, model, seed=round_index))
                our_runs.append(ours(app.base_url, seed=round_index))
    for index, (run, result) in enumerate(zip(our_runs, their_runs, strict=True)):
        # Left behind for diagnosis: every request of both clients.
        write_run_json(run, serve_logs / f"loadgen-e2e-{index}")
        vllm_path = serve_logs / f"loadgen-e2e-{index}" / "vllm-benchmark.json"
        vllm_path.write_text(json.dumps(jsonable(result), default=str))

    for run in our_runs:
        s = run.summary
        assert (s.requests, s.completed, s.rejected, s.errors) == (REQUESTS_PER_ROUND,) * 2 + (0, 0)
        assert s.input_tokens == REQUESTS_PER_ROUND * INPUT_LEN  # as the server counted them
        assert s.output_tokens == REQUESTS_PER_ROUND * OUTPUT_LEN
        assert s.length_mismatches == 0
        assert s.itl.count == REQUESTS_PER_ROUND * (OUTPUT_LEN - 1)
        # Another Serve application on the same port would share the traffic (Serve's
        # proxy binds with SO_REUSEPORT); the router's own mode label catches that.
        assert run.mode == "single", f"measured a {run.mode!r} server, not ours"
        assert run.server.requests_by_status.get("200", 0) >= REQUESTS_PER_ROUND
    for result in their_runs:
        assert result["completed"] == REQUESTS_PER_ROUND and result["failed"] == 0

    measured = [m for run in our_runs for m in run.requests if not m.warmup]
    our_ttft = statistics.median(m.ttft_s for m in measured)
    our_itl = statistics.median(gap for m in measured for gap in m.itl_s)
    their_ttft = statistics.median(t for result in their_runs for t in result["ttfts"])
    their_itl = statistics.median(
        gap for result in their_runs for gaps in result["itls"] for gap in gaps
    )
    report = (
        f"TTFT p50 ours {our_ttft * 1000:.2f} ms vs vLLM {their_ttft * 1000:.2f} ms;"
        f" ITL p50 ours {our_itl * 1000:.3f} ms vs vLLM {their_itl * 1000:.3f} ms"
    )
    print(report)
    assert our_ttft == pytest.approx(their_ttft, rel=TOLERANCE), report
    assert our_itl == pytest.approx(their_itl, rel=TOLERANCE), report
