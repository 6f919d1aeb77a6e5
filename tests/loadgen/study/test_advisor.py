"""The split advisor picks the known-best shape from results built to have one, fits
PD's thresholds by its formulas, and writes a YAML that validates and a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deployments.config import load_app_config
from loadgen.cli import main
from loadgen.study.advisor import (
    Candidate,
    Objectives,
    RunPoint,
    advise,
    choose,
    fit_pd,
    knee_of,
)

DEPLOYMENTS = Path(__file__).resolve().parents[3] / "deployments"
OBJECTIVES = Objectives(ttft_s=0.5, tpot_s=0.02, attainment=0.9)
DEVICES = {"single": 1, "dp": 2, "pd_always": 2, "pd": 2}


def _curve(shape: str, knee: float) -> list[RunPoint]:
    """Runs at 1, 2, 4, 8 req/s that meet the objectives up to ``knee``."""
    return [
        RunPoint(shape, "general", qps, 1.0 if qps <= knee else 0.4, min(qps, knee), 1024, 128)
        for qps in (1.0, 2.0, 4.0, 8.0)
    ]


def test_the_knee_is_the_last_rate_met_then_linear_to_the_first_miss() -> None:
    assert knee_of([(1, 1.0), (2, 1.0), (4, 0.5)], 0.9) == pytest.approx(2 + 2 * (0.1 / 0.5))
    assert knee_of([(1, 0.5), (2, 0.2)], 0.9) == 0.0
    assert knee_of([(1, 1.0), (2, 0.95)], 0.9) == 2


def test_the_best_goodput_per_device_wins_and_near_ties_go_to_the_simpler() -> None:
    points = _curve("single", 2) + _curve("dp", 4) + _curve("pd", 8)
    advice = advise(points, OBJECTIVES, DEVICES)
    assert advice.winner == "pd" and "highest goodput per device" in advice.reason
    near = [Candidate("dp", 2, 4.0, []), Candidate("pd", 2, 4.1, [])]
    assert choose(near)[0] == "dp"  # within 5%: the simpler one
    nobody = [Candidate("pd", 2, 0.0, []), Candidate("dp", 2, 0.0, [])]
    assert choose(nobody) == ("dp", "no shape met the objectives at any measured rate")


def test_pd_thresholds_follow_from_the_measured_rates() -> None:
    # 0.1 ms per prefill token; TPOT 5 ms at batch ~0.64 rising 0.5 ms per request.
    runs = [
        RunPoint(
            "pd",
            "general",
            qps,
            1.0,
            qps,
            1000,
            100,
            tpot_p50_s=0.005 + 0.0005 * qps * 10,
            prefill_s_per_token=1e-4,
            transfer_s_per_request=0.004,
        )
        for qps in (1.0, 2.0, 4.0)
    ]
    fit = fit_pd(runs, OBJECTIVES)
    assert fit.prefill_s_per_token == pytest.approx(1e-4)
    assert fit.prefill_capacity == pytest.approx(10.0)  # 1 / (1000 x 0.1 ms)
    assert fit.thresholds["prompt_length_threshold"] == 200  # 20 ms TPOT / 0.1 ms
    assert fit.thresholds["prefill_queue_max"] == 5  # 0.5 s / (1000 x 0.1 ms)
    step_at_max = fit.step_base_s + fit.step_per_request_s * fit.max_decode_batch
    assert OBJECTIVES.tpot_s is not None
    assert step_at_max <= OBJECTIVES.tpot_s + 1e-9
    assert fit.qos["early_rejection_s"]["low"] == pytest.approx(0.4)  # 0.5 - 0.1
    # A transfer dearer than prefilling again: never prefill remotely.
    dear = [RunPoint(**{**r.__dict__, "transfer_s_per_request": 0.5}) for r in runs]
    assert fit_pd(dear, OBJECTIVES).thresholds["prompt_length_threshold"] >= 1_000_000


def _run_document(shape: str, qps: float, met: bool) -> dict:
    ttft = 0.1 if met else 2.0
    request = {"warmup": False, "outcome": "ok", "ttft_s": ttft, "tpot_s": 0.01}
    return {
        "shape": shape, "qps": f"{qps:g}",
        "workload": {"label": "general", "mean_input_tokens": 1024, "mean_output_tokens": 128},
        "summary": {"request_throughput": qps},
        "summary_row": {"tpot_p50_ms": 10.0 + qps, "prefill_s_per_token": 5e-5,
                        "decode_step_s": 0.01},
        "server": {"kv_transfer_s_per_request": 0.003},
        "requests": [request] * 10,
    }  # fmt: skip


def test_advise_on_a_sweep_writes_a_yaml_that_validates_and_a_report(tmp_path: Path) -> None:
    _write_sweep(tmp_path / "sweep", {"single": 1, "dp": 2, "pd_always": 2, "pd": 4}, 5e-5)
    yaml_path, report = _advise(tmp_path)
    config = load_app_config(yaml_path)
    assert config.shape == "pd" and config.prefill_policy.name == "conditional"
    assert config.qos.enabled and config.qos.ttft_slo_s == pytest.approx(0.5)
    # What the split was chosen for, so the router can tell when traffic drifts from it:
    # pd met the objectives up to 4 req/s and missed them all at 8 (knee 4 + 4 x 0.1).
    profile = config.router.traffic_profile
    assert profile is not None
    assert (profile.prompt_tokens, profile.output_tokens) == (1024, 128)
    assert profile.request_rate == pytest.approx(4.4)
    assert "Serve it as `pd`" in report and "| single | 1 |" in report
    assert (tmp_path / "report" / "advice.png").stat().st_size > 0
    assert yaml.safe_load(yaml_path.read_text())["applications"][0]["name"] == "splitserve"


def _write_sweep(folder: Path, knees: dict[str, float], prefill_s_per_token: float) -> None:
    runs = folder / "runs"
    runs.mkdir(parents=True)
    for shape, knee in knees.items():
        for qps in (1, 2, 4, 8):
            document = _run_document(shape, qps, met=qps <= knee)
            document["summary_row"]["prefill_s_per_token"] = prefill_s_per_token
            (runs / f"{shape}-general-qps{qps}.json").write_text(json.dumps(document))


def _advise(tmp_path: Path, *extra: str) -> tuple[Path, str]:
    yaml_path = tmp_path / "advised.yaml"
    code = main([
        "advise", "--sweep", str(tmp_path / "sweep"), "--slo-ttft-ms", "500",
        "--slo-tpot-ms", "50", "--yaml", str(yaml_path), "--out", str(tmp_path / "report"),
        *extra,
    ])  # fmt: skip
    assert code == 0
    return yaml_path, (tmp_path / "report" / "advice.md").read_text()


def test_a_gpu_yaml_validates_and_its_pools_follow_the_fitted_ratio(tmp_path: Path) -> None:
    # Prefill is the bottleneck: 0.2 ms a token x 1024 tokens is 4.9 req/s per prefill
    # engine against 15.2 per decode engine, so four devices split 3 prefill : 1 decode.
    _write_sweep(tmp_path / "sweep", {"single": 1, "dp": 2, "pd": 4}, 2e-4)
    model = "meta-llama/Llama-3.2-1B-Instruct"
    yaml_path, report = _advise(tmp_path, "--target", "gpu", "--model", model, "--devices", "4")
    config = load_app_config(yaml_path)
    assert config.shape == "pd" and config.accelerator == "gpu"
    assert config.model.source == model and config.model.dtype == "auto"
    replicas = {pool.role: pool.replicas for pool in config.pools}
    assert replicas == {"prefill": 3, "decode": 1}
    assert all(pool.cpu_binds is None for pool in config.pools)
    assert "cpu_binds" not in yaml_path.read_text() and "kv_cache_gib" not in yaml_path.read_text()
    assert "| 4 | pd: 3 prefill, 1 decode engine(s) |" in report  # on the Pareto front
    assert (tmp_path / "report" / "advice.png").stat().st_size > 0


def test_a_target_rate_sets_how_many_engines_from_the_measured_level(tmp_path: Path) -> None:
    _write_sweep(tmp_path / "sweep", {"single": 1, "dp": 4}, 5e-5)
    yaml_path, report = _advise(tmp_path, "--target-rate", "9")
    config = load_app_config(yaml_path)
    # dp served 4.4 req/s on two engines (measured): 9 req/s needs five engines of 2.2.
    assert config.shape == "dp" and config.pools[0].replicas == 5
    assert config.pools[0].cpu_binds is None  # the template's two binds fit two engines
    assert "5 device(s): 5 mixed engine(s)" in report and "fitted from dp" in report


def test_auto_pool_engines_win_when_they_serve_more_and_keep_their_shape(
    tmp_path: Path,
) -> None:
    _write_sweep(tmp_path / "sweep", {"single": 1, "dp": 2, "pd": 2, "auto": 8}, 5e-5)
    yaml_path, report = _advise(tmp_path, "--target", "gpu", "--target-rate", "12")
    config = load_app_config(yaml_path)
    assert config.shape == "auto" and config.accelerator == "gpu"
    # auto served 8.8 req/s on two engines (measured): 12 req/s needs three of 4.4.
    assert [(pool.role, pool.replicas) for pool in config.pools] == [("mixed", 3)]
    assert "3 device(s): 3 mixed engine(s)" in report and "fitted from auto" in report


def test_the_model_sets_the_tensor_parallel_degree_each_engine_needs(tmp_path: Path) -> None:
    _write_sweep(tmp_path / "sweep", {"single": 2, "dp": 4}, 5e-5)
    model = tmp_path / "model"
    model.mkdir()
    seventy_b = {  # Llama-3-70B's shape: about 131 GiB of bf16 weights
        "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(seventy_b))
    yaml_path, report = _advise(
        tmp_path, "--target", "gpu", "--model", str(model), "--devices", "8"
    )
    config = load_app_config(yaml_path)
    # 80 GiB x 0.9 x 0.6 for weights: TP 2 (66 GiB a device) does not fit, TP 4 does.
    assert config.shape == "dp" and config.pools[0].tensor_parallel_size == 4
    assert config.pools[0].replicas == 2
    assert "each engine needs tensor parallel 4" in report
    assert "[1, 2, 4, 8]" in report


def test_repeats_give_a_median_curve_and_the_spread_of_knees(tmp_path: Path) -> None:
    _write_sweep(tmp_path / "sweep" / "repeat-1", {"single": 1, "dp": 2}, 5e-5)
    _write_sweep(tmp_path / "sweep" / "repeat-2", {"single": 2, "dp": 4}, 5e-5)
    _write_sweep(tmp_path / "sweep" / "repeat-3", {"single": 2, "dp": 4}, 5e-5)
    _, report = _advise(tmp_path)
    # single: met at 2 req/s in two repeats of three (median met), missed in one.
    assert "2: 100% [0%-100%]" in report
    # Each repeat's own knee of single: 1 + 0.1 x 1 and 2 + 0.1 x 2 (all missed past it).
    assert "1.10-2.20 (3 repeats)" in report
