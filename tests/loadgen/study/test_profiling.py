"""python -m loadgen profile against the paced fake server: the fitted decode step is the
server's token gap, and the samples say how far its gaps spread around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from loadgen.cli.profile import command_profile
from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.study.profiling import SPREAD_POINTS, gap_percentiles, spread_quantiles
from splitserve.latency.profile import LatencyProfile, StepShape, load_profile

ITL_MS = 8.0


def _profile_paced_server(out: Path, repeats: int) -> None:
    """python -m loadgen profile against a fake server: TTFT 20 ms, ITL_MS a token."""
    config = FakeServerConfig(port=0, ttft_ms=20, itl_ms=ITL_MS, shape="fake")
    with fake_server_in_thread(config) as url:
        argv = [
            "--base-url", url, "--device", "paced", "--kv-bytes-per-token", "64",
            "--kv-capacity-tokens", "4096", "--prompt-lengths", "16,64",
            "--batches", "1,2", "--contexts", "16", "--repeats", str(repeats),
            "--out", str(out),
        ]  # fmt: skip
        assert command_profile(argv, Console(quiet=True)) == 0


def test_profile_of_a_paced_server_fits_its_token_gap(tmp_path: Path) -> None:
    out = tmp_path / "paced.yaml"
    _profile_paced_server(out, repeats=1)
    profile = yaml.safe_load(out.read_text())
    batch_one = profile["step_overhead_s"] + profile["weights_read_s"] + profile["per_sequence_s"]
    assert batch_one * 1e3 == pytest.approx(ITL_MS, rel=0.25)
    # A paced server's steps hardly spread: its profile's do not either.
    assert len(profile["step_spread"]) == SPREAD_POINTS
    assert profile["step_spread"][SPREAD_POINTS // 2] == pytest.approx(1.0, abs=0.05)
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert {sample["batch"] for sample in samples["decode"]} == {1, 2}
    percentiles = samples["decode_gap_percentiles"]
    assert len(percentiles) == 99 and percentiles == sorted(percentiles)
    assert percentiles[49] == pytest.approx(1.0, abs=0.05)  # the median gap is the step


def test_spread_quantiles_are_equally_likely_values_of_the_ratios() -> None:
    ratios = [float(value) for value in range(1, 101)]  # 1..100
    assert spread_quantiles(ratios, 4) == pytest.approx([13.375, 38.125, 62.875, 87.625])
    assert spread_quantiles([], 4) == []
    assert gap_percentiles(ratios)[0] == pytest.approx(1.99)  # numpy's linear interpolation
    assert gap_percentiles(ratios)[49] == pytest.approx(50.5)


def _zero_path(path: Path, lengths: tuple[int, ...]) -> Path:
    """Baseline samples of a serving path that costs nothing."""
    path.write_text(
        json.dumps({"prefill": [{"prompt_tokens": n, "seconds": 0.0} for n in lengths]})
    )
    return path


def test_profile_fits_the_handover_from_prefills_through_a_pd_application(
    tmp_path: Path,
) -> None:
    """A "PD application" whose first token comes 40 ms after the engine's: its
    hand-over is those 40 ms less what the simulated decode engine charges beside it."""
    engine_profile = tmp_path / "paced.yaml"
    _profile_paced_server(engine_profile, repeats=3)
    out = tmp_path / "paced-pd.yaml"
    pd = FakeServerConfig(port=0, ttft_ms=60, itl_ms=ITL_MS, shape="fake")
    baseline = _zero_path(tmp_path / "pd-path.json", (16, 64))
    with fake_server_in_thread(pd) as pd_url:
        common = ["--base-url", pd_url, "--repeats", "3", "--baseline-samples", str(baseline)]
        argv = [*common, "--handover-of", str(engine_profile), "--out", str(out)]
        assert command_profile(argv, Console(quiet=True)) == 0
        # Fitted again, in place: the profile keeps one note of its hand-over.
        assert command_profile([*common, "--handover-of", str(out)], Console(quiet=True)) == 0
    before = LatencyProfile.model_validate(yaml.safe_load(engine_profile.read_text()))
    profile = LatencyProfile.model_validate(yaml.safe_load(out.read_text()))
    assert before.handover_latency_s == 0.0
    last_token = StepShape(prefill_tokens=1, attention_pairs=16, prefill_seqs=1)
    load_step = profile.step_seconds(StepShape(kv_loads=1))
    decode_side = profile.request_overhead_s + load_step + profile.step_seconds(last_token)
    assert profile.handover_latency_s == pytest.approx(0.040 - decode_side, abs=0.004)
    assert profile.step_overhead_s == before.step_overhead_s  # only the hand-over is fitted
    assert profile.source.count("hand-over fitted from lone prefills") == 1
    samples = json.loads(out.with_suffix(".samples.json").read_text())
    assert [cost["prompt_tokens"] for cost in samples["handover"]] == [16, 64]
    assert samples["decode"]  # the engine's own samples are kept beside them


def test_profile_refuses_a_handover_fit_without_the_pd_baseline(tmp_path: Path) -> None:
    argv = ["--handover-of", str(tmp_path / "any.yaml"), "--base-url", "http://127.0.0.1:9"]
    with pytest.raises(ValueError, match="--baseline-samples"):
        command_profile(argv, Console(quiet=True))


def test_profile_refuses_a_handover_fit_of_a_profile_without_its_samples(
    tmp_path: Path,
) -> None:
    shipped = tmp_path / "shipped.yaml"
    load_profile("h100-llama-3.1-8b-tp1-pp1").save(shipped)
    baseline = _zero_path(tmp_path / "pd-path.json", (16,))
    argv = ["--handover-of", str(shipped), "--baseline-samples", str(baseline)]
    with pytest.raises(ValueError, match=r"shipped\.samples\.json is missing"):
        command_profile(argv, Console(quiet=True))
