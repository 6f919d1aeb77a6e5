"""The README's commands that start an application themselves: ``make demo`` (``python -m
loadgen demo``) and ``python -m loadgen sweep`` each run a real ``serve run``, measure
it, stop it, and leave no engine behind; ``python -m deployments.serve`` stops, with
vLLM's reason, an application whose engine can never start, and stops its application
when it is stopped.

All run on the session's cluster (``RAY_ADDRESS``), which serves port 8000 only, so
no other application may run meanwhile (conftest closes the shared one first). Each
serves a copy of a YAML with synthetic engines in a folder of its own
(``--deployments-dir``): what is checked is the launch, not the model.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from deployments.launcher import DEFAULT_PORT, DEPLOYMENTS_DIR, REPO_ROOT
from splitserve.processes import ENGINE_CANNOT_START, command_lines, http_ok, stop_process

pytestmark = pytest.mark.serving

COMMAND_TIMEOUT_S = 600
REQUESTS = 4
BASE_URL = f"http://127.0.0.1:{DEFAULT_PORT}"


def _loadgen(arguments: list[str], ray_address: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RAY_ADDRESS=ray_address)
    return subprocess.run(
        [sys.executable, "-m", "loadgen", *arguments],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"


def _replicas_left() -> list[str]:
    return [c for c in command_lines().values() if c.startswith("ray::ServeReplica:")]


def _synthetic_copy(shape: str, folder: Path) -> Path:
    """deployments/<shape>.yaml with synthetic engines, in ``folder``."""
    folder.mkdir(exist_ok=True)
    document = yaml.safe_load((DEPLOYMENTS_DIR / f"{shape}.yaml").read_text())
    document["applications"][0]["args"]["engine"] = {"backend": "synthetic"}
    (folder / f"{shape}.yaml").write_text(yaml.safe_dump(document))
    return folder


def test_the_demo_serves_measures_and_stops(ray_address: str, tmp_path: Path) -> None:
    deployments = _synthetic_copy("single", tmp_path / "deployments")
    out = tmp_path / "demo"
    result = _loadgen(
        ["demo", "--config", "single", "--deployments-dir", str(deployments),
         "--num-requests", str(REQUESTS), "--rate", "4", "--out", str(out)],
        ray_address,
    )  # fmt: skip
    assert result.returncode == 0, _output(result)
    runs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    summaries = [run["summary"] for run in runs if "summary" in run and "shape" in run]
    assert [s["completed"] for s in summaries] == [REQUESTS], _output(result)
    assert [run["shape"] for run in runs if "summary" in run and "shape" in run] == ["single"]
    assert not _replicas_left(), "the demo's application outlived it"


def test_a_sweep_starts_each_mode_it_measures(ray_address: str, tmp_path: Path) -> None:
    deployments = _synthetic_copy("dp", tmp_path / "deployments")
    out = tmp_path / "sweep"
    result = _loadgen(
        ["sweep", "--shapes", "dp", "--deployments-dir", str(deployments),
         "--workloads", "general", "--qps", "4", "--num-requests", str(REQUESTS),
         "--warmup-requests", "0", "--out", str(out), "--no-plots", "--no-progress"],
        ray_address,
    )  # fmt: skip
    assert result.returncode == 0, _output(result)
    with (out / "sweep.csv").open() as rows:
        cells = list(csv.DictReader(rows))
    assert [(c["shape"], c["completed"]) for c in cells] == [("dp", str(REQUESTS))], cells
    assert (out / "logs" / "server-dp.log").exists()


def test_serve_stops_with_vllms_reason_when_an_engine_cannot_start(
    ray_address: str, tmp_path: Path
) -> None:
    """An engine whose cache cannot hold one max_model_len request never starts; Serve
    would restart its router for ever. ``python -m deployments.serve`` stops the
    application and exits 1, with vLLM's reason in what it printed."""
    document = yaml.safe_load((DEPLOYMENTS_DIR / "single.yaml").read_text())
    args = document["applications"][0]["args"]
    # vLLM's CPU blocks hold 128 tokens: 2 blocks are 256 tokens, under 4096.
    args["pools"][0]["engine_kwargs"] = {"num_gpu_blocks_override": 2}
    args["router"]["engine_restart_attempts"] = 1
    config = tmp_path / "unstartable.yaml"
    config.write_text(yaml.safe_dump(document))
    result = subprocess.run(
        [sys.executable, "-m", "deployments.serve", str(config)],
        cwd=REPO_ROOT,
        env=dict(os.environ, RAY_ADDRESS=ray_address),
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 1, _output(result)
    assert "error: the application cannot come up: " in result.stderr, _output(result)
    assert ENGINE_CANNOT_START in result.stdout, _output(result)
    assert "max seq len (4096)" in result.stdout, _output(result)  # vLLM's own reason
    assert not _replicas_left(), "the application outlived its failed launch"


def test_serve_stops_its_application_on_sigterm_even_started_in_the_background(
    ray_address: str, tmp_path: Path
) -> None:
    """A shell's background job starts with SIGINT ignored, and a service manager stops
    with SIGTERM: either way the application must stop with ``deployments.serve``, not
    go on serving from an orphaned ``serve run``."""
    config = _synthetic_copy("single", tmp_path / "deployments") / "single.yaml"

    def serving(process: subprocess.Popen[str]) -> None:
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while not http_ok(f"{BASE_URL}/health") and time.monotonic() < deadline:
            assert process.poll() is None, "deployments.serve ended before serving"
            time.sleep(1)

    _sigterm_stops_everything(
        [sys.executable, "-m", "deployments.serve", str(config)],
        ray_address,
        serving,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )


SERVE_RUN_UNTIL_KILLED = """
import sys, time
from deployments.launcher import serve_run
with serve_run(sys.argv[1]):
    print("serving", flush=True)
    time.sleep(600)
"""


def test_a_process_serving_through_the_launcher_stops_its_application_on_sigterm(
    ray_address: str, tmp_path: Path
) -> None:
    """The benches and loadgen's demo and sweep serve through deployments.launcher's
    serve_run: killed, they must not leave `serve run` serving behind them."""
    config = _synthetic_copy("single", tmp_path / "deployments") / "single.yaml"

    def serving(process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "serving"

    _sigterm_stops_everything(
        [sys.executable, "-c", SERVE_RUN_UNTIL_KILLED, str(config)],
        ray_address,
        serving,
        stdout=subprocess.PIPE,
    )


def _sigterm_stops_everything(
    command: list[str],
    ray_address: str,
    serving: Callable[[subprocess.Popen[str]], None],
    **popen: Any,
) -> None:
    """Start ``command``, wait until it serves (``serving``), SIGTERM it: it exits 128 +
    SIGTERM and leaves neither a replica nor anything answering on the port."""
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=dict(os.environ, RAY_ADDRESS=ray_address),
        stderr=subprocess.DEVNULL,
        text=True,
        **popen,
    )
    try:
        serving(process)
        assert http_ok(f"{BASE_URL}/health"), "never served"
        process.send_signal(signal.SIGTERM)
        assert process.wait(COMMAND_TIMEOUT_S) == 128 + signal.SIGTERM
    finally:
        stop_process(process, 60)
    assert not _replicas_left(), "the application outlived the process that served it"
    assert not http_ok(f"{BASE_URL}/health"), "something still serves the port"
