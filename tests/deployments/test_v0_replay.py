"""Replaying benchmarks of vLLM 0.6.0's V0 engine: a YAML's num_scheduler_steps and
enable_chunked_prefill choose the simulated engines' scheduling, are refused where the
installed vLLM would run them, and offline a multi-step group's tokens come together."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any, cast

import pytest

from deployments.app import engine_names, engine_spec
from deployments.config import ConfigError, parse_app_config
from deployments.simulate import EventQueue, VirtualEngine
from engines.contract import EngineLink
from engines.settings import EngineSpec
from engines.simulated.scheduler import SimRequest, SimScheduler
from engines.simulated.settings import engine_profile, scheduler_limits
from router.pool.pooled_engine import PooledEngine

PROFILE = "h100-llama-3.1-8b"
# LambdaLabsML/vllm-benchmark's and SGLang's vLLM 0.6.0 runs.
V0_ARGS = {"num_scheduler_steps": 10, "max_num_seqs": 256}


def _args(engine_kwargs: dict[str, Any], backend: str = "simulated") -> dict[str, Any]:
    engine = {"backend": "simulated", "profile": PROFILE} if backend == "simulated" else {}
    return {
        "shape": "single",
        "accelerator": "cpu",
        "model": {"max_model_len": 2048},
        "engine": engine,
        "pools": [{"engine_kwargs": engine_kwargs}],
    }


def _spec(engine_kwargs: dict[str, Any]) -> EngineSpec:
    config = parse_app_config(_args(engine_kwargs))
    ((name, pool, index),) = engine_names(config)
    return engine_spec(config, name, pool, index)


def test_a_v0_yaml_gives_simulated_engines_v0_scheduling_and_its_token_budget() -> None:
    spec = _spec(V0_ARGS)
    limits = scheduler_limits(spec, engine_profile(spec))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (False, 10)
    assert limits.max_num_batched_tokens == 2048  # 0.6.0's max(max_model_len, 2048)
    assert limits.max_num_seqs == 256
    default = _spec({})
    limits = scheduler_limits(default, engine_profile(default))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (True, 1)


def test_chunked_prefill_off_without_num_scheduler_steps_keeps_v1s_mixed_batches() -> None:
    # The installed vLLM (V1) batches decodes beside whole prompts with chunking off: the
    # same YAML must mean that on simulated engines, not V0's prefill-only steps.
    spec = _spec({"enable_chunked_prefill": False})
    limits = scheduler_limits(spec, engine_profile(spec))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (True, 1)
    v0 = _spec({"num_scheduler_steps": 1, "enable_chunked_prefill": False})
    limits = scheduler_limits(v0, engine_profile(v0))
    assert (limits.chunked_prefill, limits.scheduler_steps) == (False, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_args(V0_ARGS, backend="vllm"), "only engine.backend 'simulated' replays it"),
        (
            _args({**V0_ARGS, "enable_chunked_prefill": True}),
            "refuses chunked prefill with multi-step",
        ),
        (_args({"num_scheduler_steps": 0}), "at least 1"),
        (
            _args(
                {
                    "num_scheduler_steps": 1,
                    "enable_chunked_prefill": False,
                    "max_num_batched_tokens": 1024,
                }
            ),
            "below max_model_len 2048",
        ),
    ],
)
def test_what_vllm_would_not_run_is_refused(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_app_config(args)


def _engine(engine_kwargs: dict[str, Any]) -> tuple[VirtualEngine, EventQueue]:
    spec = _spec(engine_kwargs)
    queue = EventQueue()
    client = PooledEngine(spec.name, spec.role, cast(EngineLink, object()), 1.0)
    return VirtualEngine(spec, client, queue), queue


def _submit(engine: VirtualEngine, times: dict[str, list[float]], name: str, out: int) -> None:
    def on_tokens(new: list[float], done: bool) -> None:
        times.setdefault(name, []).extend(new)

    engine.submit(SimRequest(name, prompt_tokens=200, max_tokens=out), on_tokens)


def _groups(times: list[float]) -> list[int]:
    return [len(list(same)) for _, same in itertools.groupby(times)]


def test_offline_multi_step_tokens_come_in_groups_of_ten() -> None:
    engine, queue = _engine(V0_ARGS)
    times: dict[str, list[float]] = {}
    _submit(engine, times, "a", out=36)
    queue.run(until=lambda: False)
    assert _groups(times["a"]) == [1, 10, 10, 10, 5]


def test_an_arrival_cuts_a_run_at_the_end_of_the_group_in_progress() -> None:
    alone, queue = _engine(V0_ARGS)
    solo: dict[str, list[float]] = {}
    _submit(alone, solo, "a", out=61)
    queue.run(until=lambda: False)
    group_ends = sorted(set(solo["a"]))  # the prefill's token, then six groups'
    engine, queue = _engine(V0_ARGS)
    times: dict[str, list[float]] = {}
    _submit(engine, times, "a", out=61)
    # b reaches the scheduler halfway through a's third group.
    overhead = engine.profile.request_overhead_s
    arrives = (group_ends[2] + group_ends[3]) / 2 - overhead
    queue.at(arrives, _submit, engine, times, "b", 15)
    queue.run(until=lambda: False)
    assert times["a"][:31] == solo["a"][:31]  # its first three groups ran as alone
    assert times["b"][0] > group_ends[3]  # b's prefill waited for the group's end
    assert times["a"][31] > times["b"][0]  # and a's decodes for b's prefill
    assert _groups(times["a"]) == [1, 10, 10, 10, 10, 10, 10]
    assert _groups(times["b"]) == [1, 10, 4]
    assert times["b"][-1] in times["a"]  # b's last tokens came with a's group


def _replay(arrivals: list[tuple[float, str, int, int]]) -> tuple[dict[str, list[float]], int]:
    """Each request's token times, and how many events the engine took for them."""
    engine, queue = _engine(V0_ARGS)
    times: dict[str, list[float]] = {}

    def submit(name: str, prompt: int, out: int) -> None:
        def on_tokens(new: list[float], done: bool) -> None:
            times.setdefault(name, []).extend(new)

        engine.submit(SimRequest(name, prompt_tokens=prompt, max_tokens=out), on_tokens)

    for at, name, prompt, out in arrivals:
        queue.at(at, submit, name, prompt, out)
    queue.run(until=lambda: False)
    return times, queue.events


def test_runs_of_groups_give_the_same_token_times_as_group_by_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(0)
    arrivals = sorted(
        (rng.uniform(0, 1), f"r{i}", rng.randint(50, 1000), rng.randint(100, 600))
        for i in range(30)
    )
    runs, run_events = _replay(arrivals)
    monkeypatch.setattr(SimScheduler, "decode_run_length", lambda self, step: step.steps)
    groups, group_events = _replay(arrivals)
    assert run_events < 0.9 * group_events  # runs of several groups were taken
    assert runs.keys() == groups.keys() == {name for _, name, _, _ in arrivals}
    for name, times in runs.items():
        assert times == pytest.approx(groups[name], abs=1e-9)
        assert len(times) == next(out for _, n, _, out in arrivals if n == name)
