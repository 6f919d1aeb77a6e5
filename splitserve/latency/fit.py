"""Fit a latency profile to measured steps.

Two kinds of measurement, both of one engine alone: a prefill (one request, its time to
first token: the request's own overhead plus one step of its prompt) and a decode step (a
batch of requests in lockstep, the gap between their tokens). One least-squares fit over
both, with every coefficient non-negative, gives the profile's step terms; the linear
layers' memory-bound floor is the batch size below which steps stop getting cheaper,
chosen by the same fit's error over candidate sizes. A lone prefill is one request's
tokens, a decode batch as many requests as tokens: the two together tell a token's
arithmetic from a request's own cost per step (``per_sequence_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from splitserve.latency.profile import LatencyProfile, StepShape


@dataclass(frozen=True)
class PrefillSample:
    prompt_tokens: int
    seconds: float  # time to first token, alone


@dataclass(frozen=True)
class DecodeSample:
    batch: int
    context_tokens: int  # summed over the batch
    seconds: float  # one step: the gap between tokens


@dataclass(frozen=True)
class StepFit:
    request_overhead_s: float
    step_overhead_s: float
    weights_read_s: float
    compute_per_token_s: float
    per_sequence_s: float
    per_context_token_s: float
    per_attention_pair_s: float
    errors: dict[str, float]


def nonnegative_least_squares(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: fit, drop the most negative, refit."""
    active = list(range(features.shape[1]))
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coefficients


def _design(
    prefills: list[PrefillSample], decodes: list[DecodeSample], knee: int
) -> tuple[np.ndarray, np.ndarray]:
    rows, target = [], []
    for sample in prefills:
        tokens = sample.prompt_tokens
        pairs = tokens * (tokens + 1) // 2
        rows.append([1.0, 1.0, max(tokens, knee), 1.0, 0.0, pairs])
        target.append(sample.seconds)
    for decode in decodes:
        rows.append([0.0, 1.0, max(decode.batch, knee), decode.batch, decode.context_tokens, 0.0])
        target.append(decode.seconds)
    return np.array(rows, dtype=float), np.array(target, dtype=float)


def fit_steps(prefills: list[PrefillSample], decodes: list[DecodeSample]) -> StepFit:
    if len(prefills) < 2 or len(decodes) < 2:
        raise ValueError("a fit needs at least two prefill and two decode measurements")
    best: tuple[float, int, np.ndarray] | None = None
    for knee in sorted({0, 1, *(sample.batch for sample in decodes)}):
        features, target = _design(prefills, decodes, knee)
        # Relative error is what the fidelity target is in: weigh each sample by 1/time.
        weights = 1.0 / target
        coefficients = nonnegative_least_squares(features * weights[:, None], target * weights)
        error = float(np.sqrt(np.mean(((features @ coefficients) / target - 1.0) ** 2)))
        if best is None or error < best[0] - 1e-9:
            best = (error, knee, coefficients)
    assert best is not None
    _, knee, (request_s, step_s, per_token_s, per_sequence_s, context_s, pair_s) = best
    fit = StepFit(
        request_overhead_s=float(request_s),
        step_overhead_s=float(step_s),
        weights_read_s=float(per_token_s * knee),
        compute_per_token_s=float(per_token_s),
        per_sequence_s=float(per_sequence_s),
        per_context_token_s=float(context_s),
        per_attention_pair_s=float(pair_s),
        errors={},
    )
    return StepFit(**{**fit.__dict__, "errors": _errors(fit, prefills, decodes)})


def _errors(
    fit: StepFit, prefills: list[PrefillSample], decodes: list[DecodeSample]
) -> dict[str, float]:
    """Median and worst relative error of the fit on its own measurements, by kind."""

    def step(tokens: int, seqs: int, context: int, pairs: int) -> float:
        linear = max(fit.weights_read_s, fit.compute_per_token_s * tokens)
        return (
            fit.step_overhead_s
            + linear
            + fit.per_sequence_s * seqs
            + fit.per_context_token_s * context
            + fit.per_attention_pair_s * pairs
        )

    prefill_errors = [
        abs(
            fit.request_overhead_s
            + step(s.prompt_tokens, 1, 0, s.prompt_tokens * (s.prompt_tokens + 1) // 2)
            - s.seconds
        )
        / s.seconds
        for s in prefills
    ]
    decode_errors = [
        abs(step(s.batch, s.batch, s.context_tokens, 0) - s.seconds) / s.seconds for s in decodes
    ]
    return {
        "prefill_median": float(np.median(prefill_errors)),
        "prefill_max": float(np.max(prefill_errors)),
        "decode_median": float(np.median(decode_errors)),
        "decode_max": float(np.max(decode_errors)),
    }


def fitted_profile(fit: StepFit, **identity: object) -> LatencyProfile:
    """A profile from a fit; ``identity``: device, model, degrees, source, KV shape."""
    return LatencyProfile.model_validate(
        {
            "step_overhead_s": fit.step_overhead_s,
            "request_overhead_s": fit.request_overhead_s,
            "weights_read_s": fit.weights_read_s,
            "compute_per_token_s": fit.compute_per_token_s,
            "per_sequence_s": fit.per_sequence_s,
            "per_context_token_s": fit.per_context_token_s,
            "per_attention_pair_s": fit.per_attention_pair_s,
            "fit_error": fit.errors,
            **identity,
        }
    )


# The link rate a profile records when the fit finds no cost per token: one it cannot
# tell from free (a rate must be positive).
UNMEASURED_LINK_BYTES_PER_S = 1e15


@dataclass(frozen=True)
class HandoverFit:
    latency_s: float
    seconds_per_token: float

    def bytes_per_s(self, kv_bytes_per_token: int) -> float:
        if self.seconds_per_token <= 0:
            return UNMEASURED_LINK_BYTES_PER_S
        return kv_bytes_per_token / self.seconds_per_token


def handover_costs(
    engine_prefills: list[PrefillSample],
    pd_prefills: list[PrefillSample],
    profile: LatencyProfile,
) -> list[PrefillSample]:
    """What a hand-over costs at each prompt length: a lone prefill through a PD
    application over the same prefill on one engine, less what a simulated decode engine
    already charges beside the hand-over (its request overhead, its steps that load the
    KV, and the step that computes the prompt's last token again). Both prefills are
    less their serving path's own cost, so that a second engine's hop through the
    router, which a served simulation pays for real, is not counted twice."""
    alone = {sample.prompt_tokens: sample.seconds for sample in engine_prefills}
    missing = sorted({sample.prompt_tokens for sample in pd_prefills} - set(alone))
    if missing:
        raise ValueError(f"no lone prefill on one engine of {missing} tokens to compare with")
    costs = []
    for sample in pd_prefills:
        tokens = sample.prompt_tokens
        last_token = StepShape(prefill_tokens=1, attention_pairs=tokens, prefill_seqs=1)
        decode_side = (
            profile.request_overhead_s
            + profile.handover_load_steps * profile.step_seconds(StepShape(kv_loads=1))
            + profile.step_seconds(last_token)
        )
        costs.append(PrefillSample(tokens, sample.seconds - alone[tokens] - decode_side))
    return costs


def fit_handover(costs: list[PrefillSample]) -> HandoverFit:
    """A fixed latency and a cost per prompt token, both >= 0, fitted to hand-over costs
    at two or more prompt lengths (absolute error: a short prompt's cost is mostly
    noise around the latency, and relative weights would let it steer the slope)."""
    if len({cost.prompt_tokens for cost in costs}) < 2:
        raise ValueError("a hand-over fit needs costs at two or more prompt lengths")
    features = np.array([[1.0, cost.prompt_tokens] for cost in costs])
    target = np.array([cost.seconds for cost in costs])
    latency_s, per_token_s = nonnegative_least_squares(features, target)
    return HandoverFit(float(latency_s), float(per_token_s))
