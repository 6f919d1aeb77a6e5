"""Cheap checks of our vLLM plugin and its CPU pipeline-parallel repair; no engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from engines import cpu_pp_repair, vllm_plugin
from tests.support.processes import alive


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def test_entry_point_is_registered() -> None:
    plugins = entry_points(group="vllm.general_plugins")
    (ep,) = [ep for ep in plugins if ep.name == "splitserve"]
    assert ep.load() is vllm_plugin.register


def test_register_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    vllm_plugin.register()
    vllm_plugin.register()
    hooks = [f for f in sys.meta_path if isinstance(f, cpu_pp_repair._PatchAfterImport)]
    already_loaded = cpu_pp_repair.RUNNER_MODULE in sys.modules
    assert len(hooks) == (0 if already_loaded or not _cpu_platform() else 1)


def _fake_runner_module() -> types.ModuleType:
    class CPUModelRunner:
        def __init__(self) -> None:
            self.intermediate_tensors: object | None = None
            self.max_num_tokens = 8
            self.model_config = types.SimpleNamespace(dtype="bfloat16")
            self.device = "cpu"
            self.model = types.SimpleNamespace(make_empty_intermediate_tensors=self._make)

        def _make(self, batch_size: int, dtype: str, device: str) -> tuple[int, str, str]:
            return (batch_size, dtype, device)

        def load_model(self) -> None:
            pass

    module = types.ModuleType("fake_cpu_model_runner")
    module.CPUModelRunner = CPUModelRunner  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("first_rank", [True, False])
def test_patch_allocates_only_on_later_pp_ranks(
    monkeypatch: pytest.MonkeyPatch, first_rank: bool
) -> None:
    from vllm.distributed import parallel_state

    pp_group = types.SimpleNamespace(is_first_rank=first_rank)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: pp_group)
    module = _fake_runner_module()
    cpu_pp_repair.patch_cpu_model_runner(module)
    wrapped = module.CPUModelRunner.load_model
    cpu_pp_repair.patch_cpu_model_runner(module)
    assert module.CPUModelRunner.load_model is wrapped  # no double wrapping

    runner = module.CPUModelRunner()
    runner.load_model()
    assert runner.intermediate_tensors == (None if first_rank else (8, "bfloat16", "cpu"))
    runner.intermediate_tensors = existing = object()
    runner.load_model()  # an existing buffer (e.g. vLLM fixed upstream) is left alone
    assert runner.intermediate_tensors is existing


def test_cpu_model_runner_is_patched_in_a_fresh_process() -> None:
    if not _cpu_platform():
        pytest.skip("the patch only applies on the CPU platform")
    # A fresh interpreter: vLLM's CPU worker import patches torch, keep that out of pytest.
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "import vllm.v1.worker.cpu_worker\n"
        "from vllm.v1.worker.cpu_model_runner import CPUModelRunner\n"
        "from engines.cpu_pp_repair import is_patched\n"
        "assert is_patched(CPUModelRunner)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_orphan_guard_only_in_engine_children(monkeypatch: pytest.MonkeyPatch) -> None:
    from engines import orphan_guard

    monkeypatch.setattr(orphan_guard, "_started", False)
    monkeypatch.delenv(orphan_guard.ENV_FLAG, raising=False)
    assert not orphan_guard.start_orphan_guard()  # not asked for: vLLM run by someone else
    monkeypatch.setenv(orphan_guard.ENV_FLAG, "1")
    assert not orphan_guard.start_orphan_guard()  # the replica process itself is Ray's


def test_orphaned_engine_process_ends(tmp_path: Path) -> None:
    """A guarded child whose parent is SIGKILLed terminates itself within seconds."""
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import multiprocessing, os, sys, time\n"
        "def child(path):\n"
        "    from engines.orphan_guard import start_orphan_guard\n"
        "    assert start_orphan_guard()\n"
        "    open(path, 'w').write(str(os.getpid()))\n"
        "    time.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    ctx = multiprocessing.get_context('spawn')\n"
        "    ctx.Process(target=child, args=(sys.argv[1],)).start()\n"
        "    time.sleep(600)\n"
    )
    script = tmp_path / "parent.py"  # spawn needs the child function in a real file
    script.write_text(parent_code)
    env = dict(os.environ, SPLITSERVE_ORPHAN_GUARD="1")
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "guarded child did not start"
            time.sleep(0.2)
        child_pid = int(pid_file.read_text())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(child_pid), "the orphaned child outlived its parent"
