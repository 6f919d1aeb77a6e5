"""``python -m loadgen`` as a user runs it, against the fake server (no engines)."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.data.burstgpt import BurstGPTShapedGenerator, write_trace_csv
from tests.support.local_ports import free_port

REPO = Path(__file__).resolve().parents[2]


def loadgen(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadgen", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"COLUMNS": "160", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with fake_server_in_thread(FakeServerConfig(port=0, ttft_ms=2, itl_ms=1, shape="fake")) as url:
        yield url


@pytest.mark.parametrize("command", [[], ["sweep"], ["demo"], ["fake-server"], ["trace-stats"]])
def test_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m loadgen {' '.join(command)}".rstrip())
    if command in ([], ["sweep"]):
        assert "examples:" in text


def test_module_entry_point() -> None:
    result = loadgen("--help")
    assert result.returncode == 0 and "--slo-ttft-ms" in result.stdout


def test_run_writes_json_csv_and_plots(server: str, tmp_path: Path) -> None:
    result = loadgen(
        "--base-url", server, "--input-len", "64", "--output-len", "8", "--qps", "40,inf",
        "--num-requests", "12", "--out", str(tmp_path), "--no-progress",
        "--metrics-port", str(free_port()),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TTFT p50 (ms)" in result.stdout and "QPS inf" in result.stdout
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "fake-custom-64x8-qps40.json", "fake-custom-64x8-qps40.png",
        "fake-custom-64x8-qps40.vllm.json",
        "fake-custom-64x8-qpsinf.json", "fake-custom-64x8-qpsinf.png",
        "fake-custom-64x8-qpsinf.vllm.json", "summary.csv",
    ]  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [row["qps"] for row in rows] == ["40", "inf"]
    assert all(row["completed"] == "12" for row in rows)
    document = json.loads((tmp_path / "fake-custom-64x8-qps40.json").read_text())
    assert sum(not r["warmup"] for r in document["requests"]) == 12


def test_a_multi_turn_run_sends_growing_conversations(server: str, tmp_path: Path) -> None:
    result = loadgen(
        "--base-url", server, "--workload", "multi-turn", "--input-len", "16",
        "--output-len", "4", "--conversations", "2", "--system-prompt-len", "40",
        "--qps", "50", "--num-requests", "6", "--warmup-requests", "0", "--out",
        str(tmp_path), "--no-progress", "--no-plots",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (run,) = (p for p in tmp_path.glob("fake-multi-turn-*.json") if ".vllm." not in p.name)
    requests = [r for r in json.loads(run.read_text())["requests"] if not r["warmup"]]
    # System prompt: two turns of 20; each conversation's turns then add 20 apiece.
    assert sorted(r["input_len"] for r in requests) == [56, 56, 76, 76, 96, 96]
    assert all(r["outcome"] == "ok" for r in requests)


def test_a_multi_turn_run_refuses_the_chat_endpoint_by_name(server: str, tmp_path: Path) -> None:
    result = loadgen(
        "--base-url", server, "--workload", "multi-turn", "--input-len", "16",
        "--output-len", "4", "--endpoint", "chat", "--num-requests", "2", "--out",
        str(tmp_path), "--no-progress", "--no-plots",
    )  # fmt: skip
    assert result.returncode != 0
    said = " ".join((result.stdout + result.stderr).split())  # the console wraps lines
    assert "multi-turn-8x16x4 shares prompt prefixes as token ids: send it to" in said
    assert "/v1/completions, not /v1/chat/completions" in said


def test_vllm_bench_flag_names_and_result_shape(server: str, tmp_path: Path) -> None:
    """`vllm bench serve`'s flags work as they are, and its --save-result keys come out."""
    result = loadgen(
        "--base-url", server, "--random-input-len", "32", "--random-output-len", "6",
        "--request-rate", "50", "--num-prompts", "10", "--result-dir", str(tmp_path),
        "--no-progress", "--no-plots",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    ours = json.loads((tmp_path / "fake-custom-32x6-qps50.json").read_text())
    theirs = json.loads((tmp_path / "fake-custom-32x6-qps50.vllm.json").read_text())
    assert theirs["num_prompts"] == 10 and theirs["completed"] == 10
    assert theirs["request_rate"] == 50 and theirs["total_output_tokens"] == 60
    assert len(theirs["ttfts"]) == len(theirs["itls"]) == 10
    assert all(len(gaps) == 5 for gaps in theirs["itls"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for figure in ("mean", "median", "std", "p99"):
            assert f"{figure}_{metric}_ms" in theirs
    # The same requests in both files, seconds against milliseconds.
    row = ours["summary_row"]
    assert theirs["median_ttft_ms"] == pytest.approx(row["ttft_p50_ms"], rel=0.05)
    assert theirs["output_throughput"] == pytest.approx(row["output_token_throughput"])


def test_offline_trace_error_names_trace_file(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/BurstGPT_1.csv"
    result = loadgen(
        "--base-url", "http://127.0.0.1:9", "--trace", "burstgpt", "--workload", "T-general",
        "--trace-cache-dir", str(tmp_path), "--trace-url", url,
    )  # fmt: skip
    assert result.returncode == 1
    assert "--trace-file" in result.stdout and "Traceback" not in result.stderr


def test_trace_stats_on_a_generated_csv(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_trace_csv(BurstGPTShapedGenerator(seed=4).generate(5000), path)
    result = loadgen("trace-stats", "--trace-file", str(path))
    assert result.returncode == 0, result.stderr
    assert "T-prefill-heavy" in result.stdout and "2159/132" in result.stdout


# ``python -m loadgen fake-server`` that notes, once it has stopped by itself, how it
# ended: a server the sweep had to kill after its stop timeout notes nothing.
NOTING_FAKE_SERVER = """
import sys
sys.path.insert(0, {repo!r})
from loadgen.cli import main
code = main(["fake-server", *sys.argv[2:]])
with open(sys.argv[1], "a") as stops:
    stops.write(f"stopped {{code}}\\n")
sys.exit(code)
"""


@pytest.mark.usefixtures("early_starts_done")  # its servers run in a session of their own
def test_sweep_launches_and_stops_each_shape(tmp_path: Path) -> None:
    port = free_port()
    server, stops = tmp_path / "noting_fake_server.py", tmp_path / "stops.txt"
    server.write_text(NOTING_FAKE_SERVER.format(repo=str(REPO)))
    command = f"{sys.executable} {server} {stops} --port {{port}} --shape {{shape}} --ttft-ms 2"
    result = loadgen(
        "sweep", "--smoke", "--shapes", "tp,dp,pd", "--qps", "20,inf", "--num-requests", "4",
        "--workloads", "general,T-general,T-burst-replay", "--time-scale", "0.0001",
        "--launch-command", command, "--port", str(port), "--out", str(tmp_path),
        "--no-progress", "--no-plots", "--deployments-dir", str(tmp_path / "none"),
        # Guards against a hang, not paces: each wait ends as soon as its server is up
        # or gone. The whole sweep took 20-80 s on a busy two-core machine.
        "--ready-timeout", "120", "--stop-timeout", "60", timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # Each shape's server stopped on the sweep's SIGINT and exited cleanly, rather than
    # being waited out for --stop-timeout and killed (what a time bound used to catch).
    assert stops.read_text().splitlines() == ["stopped 0"] * 3
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    cells = {(r["shape"], r["workload"], r["qps"]) for r in rows}
    assert len(rows) == 3 * (2 + 2 + 1)
    assert ("pd", "T-burst-replay (synthetic)", "replay") in cells
    assert all(r["completed"] == "4" for r in rows)
    for name in ("table.md", "figure1.png", "sweep_by_qps.png", "logs/server-tp.log"):
        assert (tmp_path / name).exists(), name
    assert "GPU util %" in (tmp_path / "table.md").read_text()
    listening = socket.socket()
    assert listening.connect_ex(("127.0.0.1", port)) != 0  # every fake server stopped
    listening.close()


def test_sweep_reports_a_mode_without_application(tmp_path: Path, server: str) -> None:
    result = loadgen(
        "sweep", "--shapes", "pd", "--workloads", "general", "--qps", "inf", "--num-requests", "2",
        "--deployments-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--no-progress",
    )  # fmt: skip
    assert result.returncode == 1
    assert "pd.yaml" in result.stdout and "not measured: pd" in result.stdout


def test_sweep_against_given_urls(tmp_path: Path, server: str) -> None:
    result = loadgen(
        "sweep", "--urls", f"dp={server}", "--workloads", "general", "--qps", "inf",
        "--num-requests", "3", "--out", str(tmp_path), "--no-progress", "--no-plots",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [(r["shape"], r["workload"], r["completed"]) for r in rows] == [("dp", "general", "3")]


def test_demo_without_its_application_is_a_clear_error() -> None:
    result = loadgen("demo", "--config", "no-such-config")
    assert result.returncode == 1 and "no-such-config.yaml" in result.stdout


@pytest.mark.usefixtures("early_starts_done")  # its server runs in a session of its own
def test_demo_runs_a_burstgpt_shaped_load_and_names_the_plot(tmp_path: Path) -> None:
    command = (
        f"{sys.executable} -m loadgen fake-server --port {{port}} --shape {{shape}} --ttft-ms 1"
    )
    result = loadgen(
        "demo", "--config", "pd", "--launch-command", command, "--port", str(free_port()),
        "--num-requests", "12", "--rate", "50", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SYNTHETIC trace" in result.stdout and "T-burst-replay" in result.stdout
    plot = tmp_path / "pd-T-burst-replay_synthetic_-replay.png"
    assert f"plots: {plot}" in result.stdout.replace("\n", "") and plot.exists()


def test_a_placement_search_refuses_a_target_rate(tmp_path: Path) -> None:
    result = loadgen(
        "advise", "--simulate", "h100-llama-3.1-8b", "--devices", "8", "--target-rate", "40",
        "--slo-ttft-ms", "250", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 1
    assert "--target-rate sizes a measured shape" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr
