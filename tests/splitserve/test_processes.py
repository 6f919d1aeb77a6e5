"""splitserve/processes.py: a server that ignores its stop signal is killed, and says so."""

from __future__ import annotations

import signal
import subprocess
import sys

from splitserve.processes import ChildSettings, stop_process

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
