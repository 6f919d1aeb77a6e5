"""The names of vLLM's engine arguments (``AsyncEngineArgs``), known without importing vLLM.

A config is validated before anything starts, in processes that do not otherwise import
vLLM (the launcher, Serve's application builder), and importing
``vllm.engine.arg_utils`` costs 9-15 s there (it imports torch). The names are the
class-level annotated fields of ``EngineArgs`` and ``AsyncEngineArgs`` in vLLM's own
source, read with ``ast``; tests/engines/test_vllm_args.py checks them against the
imported dataclass, so a vLLM that declares its fields another way fails there.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Literal

ENGINE_ARG_CLASSES = ("EngineArgs", "AsyncEngineArgs")

# vLLM's KV offloading backends (vllm.config.cache.KVOffloadingBackend; the test checks it).
KVOffloadingBackend = Literal["native", "lmcache"]
# Why vLLM's native KV offloading does not run on a CPU engine, as vLLM raises it when the
# engine's worker starts (CPUOffloadingSpec.get_worker, vllm/v1/kv_offload/cpu/spec.py):
# a config is refused with it before anything starts. The test finds it in that source.
VLLM_CPU_OFFLOAD_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
VLLM_CPU_OFFLOAD_SOURCE = ("v1", "kv_offload", "cpu", "spec.py")


@functools.cache
def engine_arg_names() -> frozenset[str]:
    source = _arg_utils_source()
    if source is None:
        from vllm.engine.arg_utils import AsyncEngineArgs

        return frozenset(AsyncEngineArgs.__dataclass_fields__)
    return frozenset(_annotated_fields(ast.parse(source.read_text()), ENGINE_ARG_CLASSES))


def _arg_utils_source() -> Path | None:
    return _vllm_source("engine", "arg_utils.py")


@functools.cache
def tool_parser_names() -> frozenset[str]:
    """``--tool-call-parser``'s choices: the keys of vLLM's lazy parser registry."""
    return _registry_keys(("tool_parsers", "__init__.py"), "_TOOL_PARSERS_TO_REGISTER")


@functools.cache
def reasoning_parser_names() -> frozenset[str]:
    """``--reasoning-parser``'s choices, read as the tool parsers' are."""
    return _registry_keys(("reasoning", "__init__.py"), "_REASONING_PARSERS_TO_REGISTER")


def _registry_keys(parts: tuple[str, ...], registry: str) -> frozenset[str]:
    source = _vllm_source(*parts)
    if source is None:
        return frozenset()
    for node in ast.parse(source.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == registry and isinstance(value, ast.Dict):
            return frozenset(
                k.value
                for k in value.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
    return frozenset()


def _vllm_source(*parts: str) -> Path | None:
    # find_spec of a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    return path if path.is_file() else None


def _annotated_fields(module: ast.Module, classes: tuple[str, ...]) -> set[str]:
    names: set[str] = set()
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            names.update(
                statement.target.id
                for statement in node.body
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
            )
    return names
