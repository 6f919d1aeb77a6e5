"""The advisor's sizing: engines for a rate or a budget, PD pools in the fitted ratio at
the measured level, the Pareto front, and the tensor-parallel degrees a model allows."""

from __future__ import annotations

import itertools

import pytest

from loadgen.study.sizing import (
    Layout,
    MeasuredSize,
    PDCapacities,
    calibrated,
    model_dims,
    pareto_front,
    pareto_points,
    size_for_devices,
    size_for_rate,
)

DP = MeasuredSize("dp", 4.0, Layout((("mixed", 2),), ranks_per_engine=1))
PD = MeasuredSize("pd", 3.0, Layout((("prefill", 1), ("decode", 1)), ranks_per_engine=1))
TP = MeasuredSize("tp", 3.0, Layout((("mixed", 1),), ranks_per_engine=2))
AUTO = MeasuredSize("auto", 5.0, Layout((("mixed", 2),), ranks_per_engine=1))
# Fitted: a prefill engine serves 2 req/s, a decode engine 6; measured, the pair served 3.
FIT = PDCapacities(prefill=2.0, decode=6.0)
LLAMA_1B = {
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_mixed_engines_grow_at_the_measured_goodput_per_engine() -> None:
    sized = size_for_rate(DP, 9.0)
    assert sized is not None and sized.engines == {"mixed": 5} and sized.goodput == 10.0
    assert not sized.measured and sized.shape == "dp"
    one = size_for_rate(DP, 1.5)
    assert one is not None and one.shape == "single" and one.devices == 1
    swept = size_for_devices(DP, 2)
    assert swept is not None and swept.measured  # the size the sweep ran


def test_auto_pool_engines_grow_like_dp_and_never_below_two() -> None:
    sized = size_for_rate(AUTO, 9.0)  # 2.5 req/s an engine: four engines
    assert sized is not None and sized.shape == "auto" and sized.engines == {"mixed": 4}
    low = size_for_rate(AUTO, 1.0)  # one engine would serve it, but has no peer
    assert low is not None and low.shape == "auto" and low.engines == {"mixed": 2}
    assert low.measured
    assert size_for_devices(AUTO, 1) is None
    budget = size_for_devices(AUTO, 3)
    assert budget is not None and budget.engines == {"mixed": 3} and budget.goodput == 7.5


def test_pd_pools_follow_the_fit_scaled_to_what_was_measured() -> None:
    level = calibrated(FIT, PD)  # the fitted pair serves min(2, 6) = 2; measured 3
    assert (level.prefill, level.decode) == pytest.approx((3.0, 9.0))
    sized = size_for_rate(PD, 10.0, FIT)  # 10 / 3 -> 4 prefill, 10 / 9 -> 2 decode
    assert sized is not None and sized.engines == {"prefill": 4, "decode": 2}
    budget = size_for_devices(PD, 4, FIT)  # 3:1 serves min(9, 9) = 9, better than 2:2's 6
    assert budget is not None and budget.engines == {"prefill": 3, "decode": 1}
    assert budget.goodput == pytest.approx(9.0)
    swept = size_for_devices(PD, 2, FIT)
    assert swept is not None and swept.measured  # 1:1 is what the sweep ran


def test_a_one_engine_mode_cannot_be_sized_past_what_it_served() -> None:
    assert size_for_rate(TP, 5.0) is None
    assert size_for_devices(TP, 1) is None  # fewer devices than one engine's ranks


def test_the_front_keeps_only_layouts_that_more_devices_improve() -> None:
    front = pareto_front(pareto_points([DP, PD, TP], 4, FIT))
    # dp adds 2 req/s an engine; pd's 3:1 serves 9 on four devices, more than dp's 8.
    assert [(p.devices, p.shape, p.goodput) for p in front] == [
        (1, "single", 2.0), (2, "dp", 4.0), (3, "dp", 6.0), (4, "pd", 9.0),
    ]  # fmt: skip
    assert all(b.goodput > a.goodput for a, b in itertools.pairwise(front))


def test_a_models_tensor_parallel_degrees_and_the_one_that_fits() -> None:
    shape = model_dims(LLAMA_1B)
    assert shape.tp_degrees(8) == [1, 2, 4, 8]
    assert shape.weight_bytes / 2**30 == pytest.approx(2.3, abs=0.1)  # 1.24 B parameters
    assert shape.smallest_fitting_tp(8, 80, 0.9) == 1
    assert shape.smallest_fitting_tp(8, 2, 0.9) == 4  # 0.97 GiB for weights a device
    odd = model_dims({**LLAMA_1B, "num_attention_heads": 24, "num_key_value_heads": 6})
    assert odd.tp_degrees(8) == [1, 2, 3, 6]
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        model_dims({"num_hidden_layers": 2})
