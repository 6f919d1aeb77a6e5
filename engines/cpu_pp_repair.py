"""Make vLLM's pipeline parallelism work on the CPU platform (installed by our vLLM plugin).

What is broken in vLLM 0.32.0 (CPU): with ``pipeline_parallel_size > 1`` the engine
starts, but the first forward pass on every PP rank after the first fails with
``AssertionError: assert self.intermediate_tensors is not None`` in
``GPUModelRunner.sync_and_gather_intermediate_tensors``.

Why: without a Triton CPU backend the CPU worker uses the V1 ``CPUModelRunner``, a
subclass of ``GPUModelRunner``. That runner receives the previous stage's hidden states
by copying them into a persistent buffer, ``self.intermediate_tensors``, which
``__init__`` leaves as ``None``. The only place that allocates the buffer is
``GPUModelRunner._dummy_run``. On a GPU it always runs before serving, because
``Worker.determine_available_memory`` calls ``profile_run()``. ``CPUWorker`` overrides
that method and warms up (``profile_run`` → ``_dummy_run``) only when the model is
compiled. So with ``enforce_eager=True`` (``CompilationMode.NONE``), with LoRA (which
forces ``NONE``) or with ``VLLM_CPU_CI_ENV``, ``_dummy_run`` never runs, the buffer is
never allocated, and ``_preprocess`` fails on the first request.

How this repairs it: after ``CPUModelRunner.load_model`` returns, a wrapper allocates
the buffer the way ``_dummy_run`` would: ``model.make_empty_intermediate_tensors``
with ``max_num_tokens`` rows, the model dtype and the CPU device. The V2 runner does
the same in its ``load_model``. Because this happens before the KV cache is sized, the
memory is counted. The wrapper does nothing on the first PP rank, so PP=1 and TP-only
are unaffected. It also does nothing if the buffer already exists, so it stays harmless
once vLLM fixes the bug itself.

``cpu_worker`` must import ``vllm.v1.worker.cpu.shm`` before the model runner modules,
because ``shm`` patches torch and vLLM helpers that those modules bind when imported.
So ``install()``, which runs early in every vLLM process, does not import the runner.
Instead it patches the class right after vLLM imports it, using a one-shot import hook.
If the module is already loaded, it patches the class immediately. All of this happens
only on the CPU platform, and patching twice has no further effect.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# A child of the "vllm" logger, so messages use vLLM's handler, format and level.
logger = logging.getLogger("vllm.plugins.splitserve_cpu_pp")

RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
PATCH_MARKER = "__splitserve_cpu_pp_patched__"


def install() -> None:
    """Called by our vLLM general plugin in every vLLM process; safe to call repeatedly."""
    if not _on_cpu_platform():
        return
    module = sys.modules.get(RUNNER_MODULE)
    if module is not None:
        patch_cpu_model_runner(module)
    elif not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())


def is_patched(runner_cls: type) -> bool:
    return getattr(runner_cls.__dict__.get("load_model"), PATCH_MARKER, False)


def patch_cpu_model_runner(module: ModuleType) -> None:
    """Wrap ``CPUModelRunner.load_model`` so non-first PP ranks get their receive buffer."""
    runner_cls = getattr(module, "CPUModelRunner", None)
    if runner_cls is None or is_patched(runner_cls):
        return
    original: Callable[..., Any] = runner_cls.load_model

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _ensure_intermediate_tensors(self)
        return result

    setattr(load_model, PATCH_MARKER, True)
    runner_cls.load_model = load_model
    logger.debug("splitserve: patched %s.CPUModelRunner.load_model for PP", module.__name__)


def _ensure_intermediate_tensors(runner: Any) -> None:
    # Same allocation as GPUModelRunner._dummy_run, done only where vLLM left it undone.
    if getattr(runner, "intermediate_tensors", None) is not None:
        return
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_first_rank:
        return
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens,
        dtype=runner.model_config.dtype,
        device=runner.device,
    )
    logger.info(
        "splitserve: allocated PP intermediate tensors for %d tokens on the CPU runner",
        runner.max_num_tokens,
    )


def _on_cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Import hook: patches the CPU model runner once its module finishes loading."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != RUNNER_MODULE:
            return None
        # One shot: step out of the way, let the other finders locate the module,
        # then wrap its loader so the class is patched as soon as the module has run.
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch_cpu_model_runner(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ... for inspect, linecache and torch.compile.
        return getattr(self._loader, name)
