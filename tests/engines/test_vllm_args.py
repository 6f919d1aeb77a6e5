"""vLLM's engine argument names, read from its source without importing it, are exactly
the fields of the imported AsyncEngineArgs."""

from __future__ import annotations

from vllm.engine.arg_utils import AsyncEngineArgs

from engines.vllm_args import engine_arg_names


def test_the_names_read_from_source_are_the_dataclass_fields() -> None:
    assert engine_arg_names() == frozenset(AsyncEngineArgs.__dataclass_fields__)
