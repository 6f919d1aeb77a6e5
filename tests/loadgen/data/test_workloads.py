"""Workloads: the study's exact lengths, spread, trace subsets, prompts, reproducibility."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from pydantic import ValidationError

from loadgen.config import RunConfig, WorkloadConfig
from loadgen.data.burstgpt import BurstGPTShapedGenerator, write_trace_csv
from loadgen.data.recorded import PrefixedPrompts
from loadgen.data.workloads import (
    MIXED_CLASSES,
    RequestSize,
    TextCalibration,
    TextPrompts,
    TokenPrompts,
    plan_workload,
)

CONTEXT = 4096


@pytest.mark.parametrize(
    ("name", "lengths"),
    [("general", (1024, 128)), ("prefill-heavy", (2048, 32)), ("decode-heavy", (128, 512))],
)
def test_study_workloads_have_exact_lengths(name: str, lengths: tuple[int, int]) -> None:
    plan = plan_workload(WorkloadConfig(name=name), 200, 2, seed=0, max_model_len=CONTEXT)
    assert len(plan.sizes) == 200 and len(plan.warmup_sizes) == 2
    assert {(s.input_len, s.output_len) for s in plan.sizes} == {lengths}


def test_mixed_workload_draws_its_classes_in_their_shares() -> None:
    plan = plan_workload(WorkloadConfig(name="mixed"), 2000, 2, seed=3, max_model_len=CONTEXT)
    sizes = [(s.input_len, s.output_len) for s in plan.sizes]
    assert set(sizes) == {(i, o) for i, o, _ in MIXED_CLASSES}
    for input_len, output_len, share in MIXED_CLASSES:
        assert sizes.count((input_len, output_len)) / 2000 == pytest.approx(share, abs=0.03)
    again = plan_workload(WorkloadConfig(name="mixed"), 2000, 2, seed=3, max_model_len=CONTEXT)
    assert again.sizes == plan.sizes
    with pytest.raises(ValueError, match="exceed the server's context of 1024"):
        plan_workload(WorkloadConfig(name="mixed"), 50, 0, seed=3, max_model_len=1024)


def test_custom_spread_stays_in_range_and_is_reproducible() -> None:
    config = WorkloadConfig(name="custom", input_len=500, output_len=100, spread=0.2)
    plan = plan_workload(config, 500, 0, seed=5, max_model_len=CONTEXT)
    inputs = [s.input_len for s in plan.sizes]
    outputs = [s.output_len for s in plan.sizes]
    assert min(inputs) >= 400 and max(inputs) <= 600 and len(set(inputs)) > 50
    assert min(outputs) >= 80 and max(outputs) <= 120
    assert plan.sizes == plan_workload(config, 500, 0, seed=5, max_model_len=CONTEXT).sizes
    assert plan.sizes != plan_workload(config, 500, 0, seed=6, max_model_len=CONTEXT).sizes
    # More warm-ups do not change the measured requests.
    assert plan.sizes == plan_workload(config, 500, 7, seed=5, max_model_len=CONTEXT).sizes


def test_workload_validation_names_the_problem() -> None:
    with pytest.raises(ValidationError, match="unknown workload"):
        WorkloadConfig(name="medium")
    with pytest.raises(ValidationError, match="input_len and output_len"):
        WorkloadConfig(name="custom", input_len=10)
    with pytest.raises(ValueError, match="exceed the server's context"):
        plan_workload(WorkloadConfig(name="prefill-heavy"), 1, 0, 0, max_model_len=2048)
    with pytest.raises(ValidationError, match="base_url"):
        RunConfig(base_url="localhost:8000")


def test_trace_subsets_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_trace_csv(BurstGPTShapedGenerator(seed=2).generate(20_000), path)
    config = WorkloadConfig(name="T-prefill-heavy", trace_file=path)
    plan = plan_workload(config, 200, 2, seed=0, max_model_len=CONTEXT)
    assert all(s.input_len >= 1400 and s.output_len <= 384 for s in plan.sizes)
    assert not plan.synthetic_trace and plan.source == str(path)
    assert plan.trace_arrivals is None


def test_replay_plan_carries_the_trace_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    write_trace_csv(BurstGPTShapedGenerator(seed=2).generate(1000), path)
    config = WorkloadConfig(name="T-burst-replay", trace_file=path, trace_start=10)
    plan = plan_workload(config, 50, 2, seed=0, max_model_len=CONTEXT)
    assert plan.trace_arrivals is not None and len(plan.trace_arrivals) == 50
    assert plan.trace_arrivals == sorted(plan.trace_arrivals)
    assert all(s.input_len + s.output_len <= CONTEXT for s in plan.sizes)


def test_synthetic_trace_is_labelled() -> None:
    config = WorkloadConfig(name="T-general", trace="burstgpt-synthetic")
    plan = plan_workload(config, 20, 0, seed=0, max_model_len=CONTEXT)
    assert plan.synthetic_trace and "synthetic" in plan.label and "synthetic" in plan.source


def test_token_prompts_are_exact_and_seeded() -> None:
    prompt = TokenPrompts(seed=1).prompt(1024)
    assert len(prompt) == 1024 and all(0 <= t < 256 for t in prompt)
    assert prompt == TokenPrompts(seed=1).prompt(1024)
    assert prompt != TokenPrompts(seed=2).prompt(1024)


def test_text_prompts_follow_the_calibration() -> None:
    # A server that adds 9 template tokens and counts one token per two characters.
    calibration = TextCalibration.from_probes((64, 9 + 32), (512, 9 + 256))
    assert calibration.overhead_tokens == pytest.approx(9)
    assert calibration.tokens_per_char == pytest.approx(0.5)
    text = TextPrompts(seed=0, calibration=calibration).prompt(109)
    assert len(text) == 200
    assert TextPrompts(seed=0).prompt(50) == TextPrompts(seed=0).prompt(50)
    assert len(TextPrompts(seed=0).prompt(50)) == 50  # uncalibrated: one token per character


# ---- multi-turn ----------------------------------------------------------------------------

TURN = 10 + 5  # a user turn of 10 tokens, an answer of 5
MULTI_TURN = WorkloadConfig(
    name="multi-turn", input_len=10, output_len=5, prefix_len=20, conversations=2
)


def _prompts(sizes: list[RequestSize]) -> list[list[int]]:
    source = PrefixedPrompts(seed=1, block_tokens=TURN, low=0, high=256)
    return [source.prompt(size) for size in sizes]


def test_a_conversations_turn_starts_with_its_previous_turn_s_prompt_and_grows() -> None:
    plan = plan_workload(MULTI_TURN, 6, 2, seed=0, max_model_len=CONTEXT)
    assert plan.prefix_block_tokens == TURN and plan.label == "multi-turn-2x20+10x5"
    # The conversations take turns: 0, 1, 0, 1, ...; the system prompt is two turns long.
    assert [s.input_len for s in plan.sizes] == [40, 40, 55, 55, 70, 70]
    assert {s.output_len for s in plan.sizes} == {5}
    prompts = _prompts(plan.sizes)
    for conversation in (0, 1):
        turns = prompts[conversation::2]
        for before, after in itertools.pairwise(turns):
            # All of the previous prompt but its new user tokens is this one's start.
            assert after[: len(before) - 10] == before[:-10]
            assert after[len(before) - 10 : len(before)] != before[-10:]
    # Every conversation shares the system prompt, and only it.
    assert prompts[0][:30] == prompts[1][:30] and prompts[2][30:45] != prompts[3][30:45]


def test_a_conversation_that_would_outgrow_the_context_starts_over() -> None:
    # Room for the system prompt (30) and two turns of history before a new turn.
    context = 30 + 2 * TURN + TURN
    plan = plan_workload(MULTI_TURN, 10, 0, seed=0, max_model_len=context)
    lengths = [s.input_len for s in plan.sizes]
    assert lengths == [40, 40, 55, 55, 70, 70, 40, 40, 55, 55]
    assert max(length + 5 for length in lengths) <= context
    assert plan.sizes[6].prefix == plan.sizes[0].prefix  # the system prompt alone, again
    # A new conversation: its history is not the old one's.
    assert plan.sizes[8].prefix[-1] != plan.sizes[2].prefix[-1]


def test_warm_up_turns_share_nothing_with_the_measured_conversations() -> None:
    plan = plan_workload(MULTI_TURN, 4, 4, seed=0, max_model_len=CONTEXT)
    measured = {block for size in plan.sizes for block in size.prefix}
    warmup = {block for size in plan.warmup_sizes for block in size.prefix}
    assert warmup and not measured & warmup


def test_multi_turn_needs_its_lengths_and_room_for_one_turn() -> None:
    with pytest.raises(ValidationError, match="multi-turn needs input_len"):
        WorkloadConfig(name="multi-turn", output_len=5)
    with pytest.raises(ValueError, match="exceed the server's context of 40 tokens"):
        plan_workload(MULTI_TURN, 2, 0, seed=0, max_model_len=40)
