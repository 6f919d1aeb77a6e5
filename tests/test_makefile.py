"""The README's two set-up commands on a fresh machine: the Makefile says what is missing,
installs the CPU build unless told otherwise, and a virtualenv keeps the vLLM build it
was made with (``make -n`` shows what would run, without running it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(REPO), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _venv(tmp_path: Path, extra_file: str | None = None, stamp: str | None = None) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    if extra_file is not None:
        (venv / ".extra").write_text(extra_file + "\n")
    if stamp is not None:
        (venv / stamp).touch()
    return venv


def test_a_fresh_machine_installs_the_cpu_build(tmp_path: Path) -> None:
    run = _make("-n", "setup", f"VENV={tmp_path / 'new'}")
    assert run.returncode == 0, run.stderr
    assert "pip install -e '.[cpu,test]'" in run.stdout
    assert "echo cpu >" in run.stdout


@pytest.mark.parametrize(
    ("extra_file", "stamp"),
    [("gpu", None), (None, ".installed-gpu-0123456789ab")],
    ids=["remembered", "older-virtualenv"],
)
def test_a_gpu_virtualenv_stays_gpu_under_a_plain_make(
    tmp_path: Path, extra_file: str | None, stamp: str | None
) -> None:
    venv = _venv(tmp_path, extra_file, stamp)
    run = _make("-n", "test", f"VENV={venv}")
    assert run.returncode == 0, run.stderr
    assert "'.[gpu,test]'" in run.stdout and "[cpu" not in run.stdout


def test_mixing_builds_in_one_virtualenv_is_refused(tmp_path: Path) -> None:
    venv = _venv(tmp_path, "cpu")
    run = _make("setup", f"VENV={venv}", "EXTRA=gpu")
    assert run.returncode != 0
    assert "holds the cpu build of vLLM" in run.stderr and "VENV=.venv-gpu" in run.stderr
    assert not (venv / "bin").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["PYTHON=python3.99-missing"], "python3.99-missing not found: install Python 3.11"),
        (["PYTHON=sh"], "is not Python 3.11"),
        (["EXTRA=rocm"], "EXTRA=rocm: use cpu or gpu"),
    ],
)
def test_what_a_machine_lacks_is_named(tmp_path: Path, args: list[str], message: str) -> None:
    run = _make("preflight", f"VENV={tmp_path / 'v'}", *args)
    assert run.returncode != 0 and message in run.stderr
