"""Reports: JSON with every request, CSV summary, console table, run and sweep plots."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.outputs.report import (
    plot_figure1,
    plot_run,
    plot_sweep_by_qps,
    print_run_table,
    print_sweep_table,
    summary_row,
    write_run_json,
    write_summary_csv,
    write_sweep_markdown,
)
from loadgen.scheduling.runner import RunResult, execute_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result() -> Iterator[RunResult]:
    with fake_server_in_thread(
        FakeServerConfig(port=0, ttft_ms=2, itl_ms=1, reject_every=7)
    ) as url:
        config = RunConfig(
            base_url=url,
            workload=WorkloadConfig(name="custom", input_len=32, output_len=4),
            qps=100.0,
            num_requests=12,
            warmup_requests=1,
            show_progress=False,
            slo_ttft_ms=500,
        )
        yield asyncio.run(execute_run(config, Console(quiet=True)))


def test_json_holds_every_request(result: RunResult, tmp_path: Path) -> None:
    path = write_run_json(result, tmp_path)
    document = json.loads(path.read_text())
    assert document["run_id"] == result.run_id
    assert len(document["requests"]) == 13  # 12 measured + 1 warm-up
    first = next(r for r in document["requests"] if r["outcome"] == "ok" and not r["warmup"])
    assert {"ttft_s", "itl_s", "tpot_s", "e2e_s", "send_lag_s", "prompt_tokens"} <= set(first)
    assert len(first["itl_s"]) == 3
    assert document["config"]["qps"] == 100.0
    assert document["summary"]["rejected"] == result.summary.rejected > 0
    assert document["server"]["rejections"] is not None


def test_csv_and_console_table(result: RunResult, tmp_path: Path) -> None:
    path = write_summary_csv([summary_row(result)], tmp_path / "summary.csv")
    rows = list(csv.DictReader(path.open()))
    assert rows[0]["run_id"] == result.run_id and float(rows[0]["request_throughput"]) > 0
    assert {"ttft_p99_ms", "itl_mean_ms", "goodput", "gpu_imbalance_pct"} <= set(rows[0])
    console = Console(record=True, width=100)
    print_run_table(console, [result])
    text = console.export_text()
    assert "TTFT p95 (ms)" in text and "goodput" in text and "failures by status" in text


def test_plots_are_pngs(result: RunResult, tmp_path: Path) -> None:
    assert plot_run(result, tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    rows = []
    for shape in ("tp", "dp"):
        for qps in ("4", "8", "inf"):
            row = summary_row(result) | {"shape": shape, "qps": qps}
            rows.append(row)
    rows.append(
        summary_row(result) | {"shape": "tp", "qps": "replay", "workload": "T-burst-replay"}
    )
    assert plot_figure1(rows, tmp_path / "f1.png", "8").read_bytes().startswith(PNG_MAGIC)
    assert plot_sweep_by_qps(rows, tmp_path / "q.png").read_bytes().startswith(PNG_MAGIC)
    table = write_sweep_markdown(rows, tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| shape | workload | QPS | done | req/s | total tok/s")
    assert len(table) == 2 + len(rows)
    console = Console(record=True, width=160)
    print_sweep_table(console, rows)
    assert "GPU imbalance" in console.export_text()
