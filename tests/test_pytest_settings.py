"""The suite's own pytest settings (pyproject.toml) make a test fail where pytest's
defaults would let it pass while wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_an_exception_in_a_test_thread_fails_the_test(tmp_path: Path) -> None:
    """Under the suite's own pytest settings: a served test's client thread that dies
    fails its test instead of leaving fewer answers to check."""
    (tmp_path / "test_thread.py").write_text(
        "import threading\n\n\n"
        "def test_client_thread_dies() -> None:\n"
        "    thread = threading.Thread(target=lambda: 1 / 0)\n"
        "    thread.start()\n"
        "    thread.join()\n"
    )
    settings = ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *settings, "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout
    assert "1 failed" in run.stdout and "ZeroDivisionError" in run.stdout
