"""Fit each GPU's host terms on its calibration runs (a fit, not a test).

The roofline (splitserve/latency/roofline.py) prices what the device computes; what the
engine's host adds beside it is fitted here, per device, on the public runs named in
``splitserve.latency.published.CALIBRATION`` and on nothing else:

- ``request_overhead_s``: the front end's input processing of a request, one after
  another (engines/simulated/frontend.py);
- ``per_sequence_s``: each scheduled request's share of a step (inputs, sampling, its
  output), which makes a large batch's step dearer than its tokens;
- ``quantized_layer_s``: per decoder layer and step of an FP8 checkpoint, the kernels
  that quantize activations and scale outputs;
- ``quantized_compute``: the share of the 16-bit GEMMs' efficiency that an FP8
  checkpoint's GEMMs reach (a prefill's rate: the published first tokens of 70B FP8
  came about 1.25x later than FP8's peak at the 16-bit share predicts).

Each candidate is replayed offline on every calibration run of its device
(bench/sim_published.py's replay) and scored by the sum of squared log ratios of TTFT
p50, TPOT p50 and output throughput to the published figures; a coordinate descent of
golden-section searches finds the least. The held-out runs are then replayed once with
the fitted terms, and their error is recorded beside the terms: the band the advisor
prints. Writes splitserve/latency/public_runs/fitted.yaml; then
``python -m splitserve.latency.catalog`` writes the shipped profiles from it.

    python bench/fit_published.py [--devices h100,a100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from sim_published import Replay, errors, replay

from splitserve.latency.catalog import FITTED_PATH, HostTerms, catalog_profile
from splitserve.latency.published import ReplaySpec, replay_specs

console = Console()
# The terms' ranges: wide enough for any host, from no cost up.
BOUNDS = {
    "request_overhead_s": (0.0, 0.010),
    "per_sequence_s": (0.0, 100e-6),
    "quantized_layer_s": (0.0, 100e-6),
    "quantized_compute": (0.3, 1.0),
}
QUANTIZED_TERMS = ("quantized_layer_s", "quantized_compute")
GOLDEN = (math.sqrt(5) - 1) / 2
SEARCH_STEPS = 14  # golden-section narrowings per term and round: 0.2% of its range


def replays(specs: list[ReplaySpec], host: HostTerms) -> list[Replay]:
    return [
        replay(s, catalog_profile(s.device, s.model, s.run.tensor_parallel_size, 1, host=host))
        for s in specs
    ]


def loss(specs: list[ReplaySpec], host: HostTerms) -> float:
    return sum(
        math.log(ratio) ** 2 for item in replays(specs, host) for ratio in item.ratios().values()
    )


def golden_section(score: Callable[[float], float], low: float, high: float) -> float:
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = score(c), score(d)
    for _ in range(SEARCH_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = score(c)
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = score(d)
    return (a + b) / 2


def fit_device(specs: list[ReplaySpec], rounds: int) -> HostTerms:
    defaults = HostTerms()
    terms: dict[str, float] = {name: getattr(defaults, name) for name in BOUNDS}
    quantized = any("fp8" in s.model for s in specs)
    names = [n for n in BOUNDS if quantized or n not in QUANTIZED_TERMS]
    for round_ in range(rounds):
        for name in names:

            def score(value: float, name: str = name) -> float:
                return loss(specs, HostTerms(**{**terms, name: value}))

            terms[name] = golden_section(score, *BOUNDS[name])
        best = loss(specs, HostTerms(**terms))
        shown = ", ".join(_shown(k, v) for k, v in terms.items())
        console.print(f"  round {round_ + 1}: {shown}; loss {best:.4f}")
    return HostTerms(**terms)


def _shown(name: str, value: float) -> str:
    return f"{name} {value * 1e6:.1f} us" if name.endswith("_s") else f"{name} {value:.3f}"


def rounded_errors(items: list[Replay]) -> dict[str, float]:
    return {key: round(value, 4) for key, value in errors(items).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="h100,a100")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=FITTED_PATH)
    args = parser.parse_args()
    specs = replay_specs()
    devices: dict[str, Any] = {}
    for device in args.devices.split(","):
        calibration = [s for s in specs if s.device == device and s.set == "calibration"]
        held_out = [s for s in specs if s.device == device and s.set == "held-out"]
        versions = sorted({s.run.version or "unknown" for s in calibration})
        console.print(f"{device}: fitting on {len(calibration)} runs (vLLM {versions})")
        fitted = fit_device(calibration, args.rounds)
        terms = fitted.model_copy(
            update={
                "vllm_version": ", ".join(versions),
                "calibration_runs": [s.run.id for s in calibration],
                "held_out_runs": [s.run.id for s in held_out],
            }
        )
        terms = terms.model_copy(
            update={
                "calibration_error": rounded_errors(replays(calibration, terms)),
                "held_out_error": rounded_errors(replays(held_out, terms)),
            }
        )
        console.print(f"  calibration error {terms.calibration_error}")
        console.print(f"  held-out error {terms.held_out_error}")
        devices[device] = terms.model_dump(mode="json")
    header = (
        "# Written by bench/fit_published.py: each device's host terms, fitted on its"
        " calibration runs\n# (splitserve/latency/public_runs/runs.yaml), and the error"
        " of a replay on those and on its\n# held-out runs, never fitted on. The catalog"
        " builds the shipped profiles from it.\n"
    )
    args.out.write_text(header + yaml.safe_dump({"devices": devices}, sort_keys=False))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
