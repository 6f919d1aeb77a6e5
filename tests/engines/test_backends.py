"""Every registered engine backend, and the metered wrapper a scaled pool's transport
serves instead, implements the one engine contract, call for call."""

from __future__ import annotations

import inspect

import pytest

from engines.backends import ENGINE_BACKENDS
from engines.contract import EngineBackend
from engines.slo_meter import MeteredHost

CONTRACT = sorted(name for name in vars(EngineBackend) if not name.startswith("_"))
BACKENDS = ["vllm", "simulated", "synthetic"]


def _implementations() -> list[tuple[str, object]]:
    # Each backend's class, read by getattr: the registry types them as their callable.
    return [(name, ENGINE_BACKENDS.get(name)) for name in BACKENDS] + [("metered", MeteredHost)]


@pytest.mark.parametrize(("name", "implementation"), _implementations())
def test_an_engine_has_every_call_of_the_contract_with_its_parameters(
    name: str, implementation: object
) -> None:
    for call in CONTRACT:
        expected = getattr(EngineBackend, call)
        actual = getattr(implementation, call, None)
        assert actual is not None, f"{name} lacks {call}"
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{name}.{call} is not a property"
            continue
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected) or (
            inspect.isasyncgenfunction(actual) and call == "deltas"
        ), f"{name}.{call}: async where the contract is not, or the other way round"
        assert list(inspect.signature(actual).parameters) == list(
            inspect.signature(expected).parameters
        ), f"{name}.{call} takes other parameters than the contract"


@pytest.mark.parametrize("name", BACKENDS)
def test_a_backend_is_built_from_its_engines_spec_alone(name: str) -> None:
    parameters = list(inspect.signature(ENGINE_BACKENDS.get(name)).parameters)
    assert parameters == ["spec"]
