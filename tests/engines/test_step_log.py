"""The step log's reading of a scheduler output (the served test,
tests/deployments/test_shapes_served.py, reads a real engine's), and its setting."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pydantic import ValidationError

from engines.settings import EngineBackendConfig
from engines.step_log import _shape


@dataclass
class _Request:
    num_prompt_tokens: int
    num_computed_tokens: int  # as vLLM leaves it once schedule() returns: chunk included


@dataclass
class _Scheduler:
    requests: dict[str, _Request] = field(default_factory=dict)


@dataclass
class _Output:
    num_scheduled_tokens: dict[str, int]


def test_a_step_is_read_as_a_profile_counts_it() -> None:
    scheduler = _Scheduler(
        {
            # A prompt's second chunk of 100 tokens, after 200 computed.
            "chunked": _Request(num_prompt_tokens=500, num_computed_tokens=300),
            # A whole prompt of 50 tokens.
            "whole": _Request(num_prompt_tokens=50, num_computed_tokens=50),
            # Decodes: 40 and 7 tokens of context before this step's token.
            "decoding": _Request(num_prompt_tokens=30, num_computed_tokens=41),
            "short": _Request(num_prompt_tokens=5, num_computed_tokens=8),
        }
    )
    output = _Output({"chunked": 100, "whole": 50, "decoding": 1, "short": 1, "gone": 3})
    shape = _shape(scheduler, output)
    assert shape is not None
    prefill_tokens, prefill_seqs, pairs, decode_seqs, context = shape
    assert (prefill_tokens, prefill_seqs, decode_seqs) == (150, 2, 2)
    # Each query attends to what came before it and itself.
    assert pairs == 100 * 200 + 100 * 101 // 2 + 50 * 51 // 2
    # As the simulated scheduler counts it: the context computed, and the new token.
    assert context == (40 + 1) + (7 + 1)


def test_a_step_that_computes_nothing_is_not_logged() -> None:
    assert _shape(_Scheduler(), _Output({})) is None


def test_only_vllm_engines_log_steps() -> None:
    assert EngineBackendConfig(step_log="steps").step_log == "steps"
    with pytest.raises(ValidationError, match=r"step_log is for engine\.backend 'vllm' only"):
        EngineBackendConfig(backend="synthetic", step_log="steps")
