"""What engines/vllm_args.py knows of vLLM without importing it, checked against the
imported vLLM: its engine argument names, its KV offloading backends, and the reason it
gives for not offloading a CPU engine's KV."""

from __future__ import annotations

import ast
import typing

from vllm.config.cache import KVOffloadingBackend as VllmKVOffloadingBackend
from vllm.engine.arg_utils import AsyncEngineArgs

from engines.vllm_args import (
    VLLM_CPU_OFFLOAD_REFUSAL,
    VLLM_CPU_OFFLOAD_SOURCE,
    KVOffloadingBackend,
    _vllm_source,
    engine_arg_names,
)


def test_the_names_read_from_source_are_the_dataclass_fields() -> None:
    assert engine_arg_names() == frozenset(AsyncEngineArgs.__dataclass_fields__)


def test_the_offloading_backends_are_vllms() -> None:
    assert set(typing.get_args(KVOffloadingBackend)) == set(
        typing.get_args(VllmKVOffloadingBackend)
    )


def test_the_cpu_offloading_refusal_is_the_one_vllm_raises() -> None:
    """A vLLM that offloads CPU engines, or words its refusal otherwise, fails here: the
    config's refusal (deployments/config.py) would then be wrong or quote a stale reason."""
    source = _vllm_source(*VLLM_CPU_OFFLOAD_SOURCE)
    assert source is not None, f"vLLM has no {'/'.join(VLLM_CPU_OFFLOAD_SOURCE)}"
    constants = {
        node.value
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    assert VLLM_CPU_OFFLOAD_REFUSAL in constants
