"""Every registered engine backend implements the one engine contract, call for call."""

from __future__ import annotations

import inspect

import pytest

from engines.backends import ENGINE_BACKENDS, EngineBackend

CONTRACT = sorted(
    name for name in vars(EngineBackend) if not name.startswith("_") or name == "__init__"
)


@pytest.mark.parametrize("name", ["vllm", "simulated", "synthetic"])
def test_a_backend_has_every_call_of_the_contract_with_its_parameters(name: str) -> None:
    backend = ENGINE_BACKENDS.get(name)
    for call in CONTRACT:
        expected = getattr(EngineBackend, call)
        actual = getattr(backend, call, None)
        assert actual is not None, f"{name} lacks {call}"
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{name}.{call} is not a property"
            continue
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected), (
            f"{name}.{call}: async where the contract is not, or the other way round"
        )
        assert list(inspect.signature(actual).parameters) == list(
            inspect.signature(expected).parameters
        ), f"{name}.{call} takes other parameters than the contract"
