"""splitserve/processes.py: a server that ignores its stop signal is killed, and says so;
the processes a server started are found however deep, and by a variable they inherited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.processes import (
    SERVE_DEPLOY_FAILED,
    ChildSettings,
    LaunchError,
    command_lines,
    descendants,
    pids_with_env_entry,
    start_process,
    stop_process,
    wait_gone,
    wait_until_ready,
)

IGNORES_SIGINT = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)
STOPS_ON_SIGINT = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"


def _started(source: str) -> subprocess.Popen[bytes]:
    # Started as the launcher starts servers: SIGINT restored, which a test run from a
    # background shell job would otherwise hand down ignored.
    process = subprocess.Popen(
        [sys.executable, "-c", source], stdout=subprocess.PIPE, preexec_fn=ChildSettings()
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def test_a_process_that_ignores_the_stop_signal_is_killed_and_named() -> None:
    process = _started(IGNORES_SIGINT)
    assert stop_process(process, timeout_s=1.0) == {process.pid}
    assert process.returncode == -signal.SIGKILL


def test_a_process_that_stops_names_nothing() -> None:
    process = _started(STOPS_ON_SIGINT)
    assert stop_process(process, timeout_s=10.0) == set()
    assert process.returncode not in (None, -signal.SIGKILL)


@pytest.mark.skipif(
    not Path("/proc/self/autogroup").exists(), reason="the kernel's autogroup is off here"
)
def test_a_server_in_a_session_of_its_own_gets_its_niceness_as_a_group() -> None:
    # With autogroup on, sessions share the CPU as equals before niceness counts: the
    # server's whole session must be niced, or its client waits behind it.
    source = "print(open('/proc/self/autogroup').read(), flush=True)"
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=ChildSettings(niceness=15, new_session=True),
    )
    assert done.stdout.strip().endswith("nice 15")
    assert Path("/proc/self/autogroup").read_text().strip() != done.stdout.strip()


def test_a_server_whose_log_says_it_will_never_be_ready_fails_at_once(tmp_path: Path) -> None:
    # What `serve run` prints when Serve gives up on a replica, and then keeps running.
    source = (
        "import time\n"
        "print('(ServeController pid=1) INFO -- Deploying new app ', flush=True)\n"
        "time.sleep(0.3)\n"
        "print('(ServeController pid=1) ERROR -- Failed to update the deployments"
        " [\\'Router\\'].', flush=True)\n"
        "time.sleep(60)\n"
    )
    log_path = tmp_path / "serve.log"
    process = start_process([sys.executable, "-c", source], log_path)
    try:
        with pytest.raises(LaunchError, match=r"failed: .*Failed to update the deployments"):
            wait_until_ready(
                process, lambda: False, log_path, 50.0, "serve run", SERVE_DEPLOY_FAILED
            )
        assert process.poll() is None  # it said so; it did not exit
    finally:
        stop_process(process, timeout_s=10.0)


def test_descendants_however_deep_found_by_what_they_inherited_and_waited_out() -> None:
    marker = f"SPLITSERVE_PROCESS_TEST={os.getpid()}"
    # A shell that starts a shell that starts a sleep: two levels below the root.
    source = "sleep 30 & sh -c 'sleep 30 & echo ready; wait' & wait"
    env = dict(os.environ, SPLITSERVE_PROCESS_TEST=str(os.getpid()))
    root = subprocess.Popen(["sh", "-c", source], env=env, stdout=subprocess.PIPE)
    try:
        assert root.stdout is not None and root.stdout.readline() == b"ready\n"
        below = descendants(root.pid)
        commands = command_lines()
        assert len([pid for pid, _ in below if commands.get(pid, "").startswith("sleep")]) == 2
        inherited = pids_with_env_entry(lambda entry: entry == marker.encode())
        assert {pid for pid, _ in below} | {root.pid} <= inherited
    finally:
        stop_process(root, timeout_s=5, stop_signal=signal.SIGTERM)
    assert wait_gone(below, timeout_s=5) == set()
