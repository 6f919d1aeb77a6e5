"""``python -m loadgen report``: the dashboard's key panels as PNG, from a real run's JSON
(against the load generator's fake server) and from a sweep-shaped folder."""

from __future__ import annotations

import asyncio
import csv
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from loadgen.cli import main
from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.outputs.panels import ReportError, render_report, timeline
from loadgen.outputs.report import run_document, summary_row, write_run_json, write_summary_csv
from loadgen.scheduling.runner import RunResult, execute_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REQUESTS = 20


@pytest.fixture(scope="module")
def result() -> Iterator[RunResult]:
    with fake_server_in_thread(
        FakeServerConfig(port=0, ttft_ms=5, itl_ms=2, reject_every=5)
    ) as url:
        config = RunConfig(
            base_url=url,
            workload=WorkloadConfig(name="custom", input_len=32, output_len=8),
            qps=40.0,
            arrival_process="constant",
            num_requests=REQUESTS,
            warmup_requests=1,
            show_progress=False,
        )
        yield asyncio.run(execute_run(config, Console(quiet=True)))


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_report_of_one_run_json(result: RunResult, tmp_path: Path) -> None:
    run_json = write_run_json(result, tmp_path)
    assert main(["report", str(run_json)]) == 0
    [png] = tmp_path.glob("*.panels.png")
    assert _is_png(png)


def test_timeline_counts_every_completed_request(result: RunResult) -> None:
    document = run_document(result)
    measured = [r for r in document["requests"] if not r["warmup"]]
    series = timeline(measured, bin_s=0.1)
    ok = sum(1 for r in measured if r["outcome"] == "ok")
    assert sum(series["completed"]) * 0.1 == pytest.approx(ok)
    assert ok < REQUESTS  # the fake server rejects every fifth request
    outputs = sum(r["output_tokens"] for r in measured if r["outcome"] == "ok")
    assert sum(series["tokens"]) * 0.1 == pytest.approx(outputs)


def test_timeline_in_flight_at_each_bin_start() -> None:
    requests = [
        {"sent_s": 0.0, "done_s": 1.5, "outcome": "ok", "output_tokens": 4},
        {"sent_s": 0.5, "done_s": 2.5, "outcome": "rejected", "output_tokens": 0},
    ]
    series = timeline(requests, bin_s=1.0)
    assert series["t"] == [0.0, 1.0, 2.0]
    assert series["in_flight"] == [1, 2, 1]
    assert series["completed"] == [0.0, 1.0, 0.0]  # the rejected one is not completed
    assert series["tokens"] == [0.0, 4.0, 0.0]


def test_report_of_a_sweep_folder(result: RunResult, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    runs = sweep / "runs"
    write_run_json(result, runs)
    rows = []
    for shape in ("dp", "pd"):  # two shapes' rows, as a sweep writes them
        row = summary_row(result)
        row["shape"] = shape
        rows.append(row)
    write_summary_csv(rows, sweep / "sweep.csv")
    written = render_report(sweep, tmp_path / "out")
    names = sorted(path.name for path in written)
    assert any(name.startswith("figure1_qps") for name in names)
    assert "sweep_by_qps.png" in names
    assert f"{result.run_id}.panels.png" in names
    assert all(_is_png(path) for path in written)


def test_sweep_csv_numbers_are_read_back(result: RunResult, tmp_path: Path) -> None:
    from loadgen.outputs.panels import read_rows

    path = write_summary_csv([summary_row(result)], tmp_path / "sweep.csv")
    [row] = read_rows(path)
    assert row["qps"] == "40" and isinstance(row["request_throughput"], float)
    with path.open() as file:
        assert next(csv.DictReader(file))["shape"] == row["shape"]


def test_report_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ReportError):
        render_report(tmp_path / "other.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError):
        render_report(empty)
    assert main(["report", str(tmp_path / "missing.json")]) == 1
    shutil.rmtree(empty)
