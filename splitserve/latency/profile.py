"""A latency profile: how long one engine step takes on one (device, model, parallel
degree), from what the step computes, and how much KV the engine holds.

One step of a continuous-batching engine runs every scheduled request's new tokens
through the model at once. Its time has the parts a roofline names:

- the linear layers: they read every weight once per step (``weights_read_s``, the
  memory-bound floor) and do ``compute_per_token_s`` of arithmetic per new token; the
  slower of the two is what the step pays (``max``);
- attention: a decode token reads its whole context's KV (``per_context_token_s``), a
  prefill chunk's tokens attend to each other and to what is cached before them
  (``per_attention_pair_s`` per query-key pair);
- what does not overlap the arithmetic: the step's fixed cost (scheduling, launches),
  each scheduled request's own (``per_sequence_s``: its inputs, sampling, its output; what
  makes a decode batch's token dearer than a prefill's on a host-bound engine), and TP's
  all-reduces and PP's hand-offs per token (``serial_per_token_s``).

Profiles are fitted from measurements (``python -m loadgen profile``) or built from a
roofline of published specs (splitserve/latency/roofline.py); ``source`` says which, and
where every number comes from.
"""

from __future__ import annotations

import functools
import importlib.resources
import random
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import Field, field_validator

from splitserve.config_base import StrictModel

PROFILES_PACKAGE = "splitserve.latency.profiles"


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes (a plain class: a simulation builds one per step)."""

    prefill_tokens: int = 0
    # Sum over the step's prefill chunks of chunk tokens x the keys each attends to.
    attention_pairs: int = 0
    # Requests with a prefill chunk in the step.
    prefill_seqs: int = 0
    decode_seqs: int = 0
    # Sum of the decode requests' context lengths (the KV they read).
    decode_context_tokens: int = 0
    # PD: requests whose handed-over KV this step loads (a step with nothing else to
    # compute still runs, for the connector alone).
    kv_loads: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


class LatencyProfile(StrictModel):
    """Step time and KV capacity of one engine: one device type, one model, one TP x PP."""

    device: str = Field(description="e.g. 'H100-SXM-80GB' or 'cpu-2core'.")
    model: str = Field(description="The model the times are for, e.g. 'Llama-3.1-8B'.")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    source: str = Field(
        min_length=1, description="Where the numbers come from: measurements or specs, named."
    )
    step_overhead_s: float = Field(ge=0, description="Fixed cost of every step.")
    request_overhead_s: float = Field(
        0.0,
        ge=0,
        description="Per request, before it is scheduled: the engine's front end (input"
        " processing), which an engine behind the router still pays.",
    )
    weights_read_s: float = Field(
        ge=0, description="Reading the weights once: the linear layers' memory-bound floor."
    )
    compute_per_token_s: float = Field(ge=0, description="Linear layers' arithmetic per token.")
    serial_per_token_s: float = Field(
        0.0, ge=0, description="Per token, beside the arithmetic: TP all-reduces, PP hand-offs."
    )
    per_sequence_s: float = Field(
        0.0,
        ge=0,
        description="Per request scheduled in a step, beside its tokens: preparing its inputs,"
        " sampling, its output. Fitted profiles measure it; the roofline's leave it at 0.",
    )
    per_context_token_s: float = Field(
        ge=0, description="Decode attention: reading one context token's KV."
    )
    per_attention_pair_s: float = Field(
        ge=0, description="Prefill attention: one query token against one key token."
    )
    kv_bytes_per_token: int = Field(gt=0, description="The model's KV per token, all layers.")
    kv_capacity_tokens: int = Field(gt=0, description="Tokens of KV the engine's cache holds.")
    handover_bytes_per_s: float = Field(
        gt=0, description="PD: the KV link's rate between two engines (the host path's)."
    )
    handover_latency_s: float = Field(0.0, ge=0, description="PD: fixed cost of one hand-over.")
    handover_load_steps: int = Field(
        1,
        ge=0,
        description="PD: engine steps a decode engine spends loading a handed-over prompt's"
        " KV before the step that computes its last token. vLLM hears of an asynchronous"
        " load's end with a step's output and schedules the request in the step after: 1"
        " for ours and NIXL's; 0 for a connector that loads within the computing step.",
    )
    handover_cpu_s: float = Field(
        0.0,
        ge=0,
        description="PD, engine.spend: cpu only: the host CPU one hand-over costs (the"
        " prefill engine's put, the decode engine's get, the KV directory's messages),"
        " computed once the KV has crossed the link, one hand-over at a time, on any core:"
        " where the engines share their cores with the host, it slows them as the real"
        " path does. Offline and with spend: wall it costs nothing.",
    )
    # vLLM's defaults on this device for an OpenAI server (EngineArgs'
    # _set_default_max_num_seqs_and_batched_tokens_args), and its KV block size.
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    block_size: int = Field(16, gt=0)
    max_model_len: int = Field(8192, gt=0, description="The context engines are given.")
    vllm_version: str | None = Field(
        None,
        description="The vLLM whose runs the host's terms (request_overhead_s,"
        " per_sequence_s) were fitted on; another version's scheduler and front end"
        " cost what they cost there.",
    )
    calibration_runs: list[str] = Field(
        default_factory=list,
        description="Public runs the profile's fitted terms were fitted on, by id"
        " (splitserve/latency/public_runs/runs.yaml: source, vLLM version, settings).",
    )
    held_out_runs: list[str] = Field(
        default_factory=list,
        description="Public runs of the same device never fitted on, replayed to measure"
        " the profile's error (bench/sim_published.py).",
    )
    held_out_error: dict[str, float] = Field(
        default_factory=dict,
        description="|simulated / published - 1| over the held-out runs, per figure:"
        " '<figure> median' and '<figure> worst'. The advisor's error band.",
    )
    fit_error: dict[str, float] = Field(
        default_factory=dict,
        description="Fitted profiles: relative error of the fit on its measurements.",
    )
    step_spread: list[float] = Field(
        default_factory=list,
        description="Fitted profiles: equally likely values of a step's time over its fitted"
        " (median) time, as the engine's decode gaps spread; each simulated step draws one."
        " Empty: every step takes its fitted time (the roofline's profiles).",
    )

    @field_validator("step_spread")
    @classmethod
    def _spread_of_ratios(cls, spread: list[float]) -> list[float]:
        # A 0 is a token that came with the one before it: two gaps, 0 and twice a step.
        if any(value < 0 for value in spread) or (spread and not any(spread)):
            raise ValueError(
                "step_spread's values are ratios to the fitted time: none below 0, some above"
            )
        return spread

    def step_seconds(self, step: StepShape) -> float:
        if step.tokens == 0:
            # vLLM runs a step without a forward pass for the connector's loads alone.
            return self.step_overhead_s if step.kv_loads else 0.0
        linear = max(self.weights_read_s, self.compute_per_token_s * step.tokens)
        return (
            self.step_overhead_s
            + linear
            + self.serial_per_token_s * step.tokens
            + self.per_sequence_s * (step.prefill_seqs + step.decode_seqs)
            + self.per_context_token_s * step.decode_context_tokens
            + self.per_attention_pair_s * step.attention_pairs
        )

    def decode_run_ends(self, batch: int, context_tokens: int, steps: int) -> list[float]:
        """When each of ``steps`` decode-only steps of a fixed batch ends, from the first's
        start: every step reads one more token of context per request than the last."""
        fixed = (
            self.step_overhead_s
            + max(self.weights_read_s, self.compute_per_token_s * batch)
            + (self.serial_per_token_s + self.per_sequence_s) * batch
        )
        growth = self.per_context_token_s * batch
        first = fixed + self.per_context_token_s * context_tokens
        # The i-th step (from 0) takes first + i * growth; its end is the sum up to it.
        return [(i + 1) * first + growth * i * (i + 1) / 2 for i in range(steps)]

    def handover_seconds(self, tokens: int) -> float:
        """Moving ``tokens`` of KV from a prefill engine to a decode engine, alone."""
        return self.handover_latency_s + self.handover_bytes_seconds(tokens)

    def handover_bytes_seconds(self, tokens: int) -> float:
        """The part of a hand-over its link carries: ``tokens`` of KV at the link's rate
        (what hand-overs to one engine queue for; their latencies overlap)."""
        return tokens * self.kv_bytes_per_token / self.handover_bytes_per_s

    def save(self, path: Path) -> None:
        path.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False))


class StepTimes:
    """A profile's step times as one engine lives them: each step's fitted time, times a
    draw from the profile's ``step_spread`` where it has one. Seeded (offline: by the
    engine's name), so that a simulation replays exactly."""

    def __init__(self, profile: LatencyProfile, seed: str) -> None:
        self.profile = profile
        self._spread = profile.step_spread
        self._rng = random.Random(seed)

    def step(self, step: StepShape) -> float:
        seconds = self.profile.step_seconds(step)
        return seconds * self._draw() if self._spread and seconds else seconds

    def decode_run_ends(self, batch: int, context_tokens: int, steps: int) -> list[float]:
        """LatencyProfile.decode_run_ends, each step drawn as ``step`` draws it."""
        ends = self.profile.decode_run_ends(batch, context_tokens, steps)
        if not self._spread:
            return ends
        drawn, previous, total = [], 0.0, 0.0
        for end in ends:
            total += (end - previous) * self._draw()
            previous = end
            drawn.append(total)
        return drawn

    def _draw(self) -> float:
        return self._spread[self._rng.randrange(len(self._spread))]


def shipped_profiles() -> list[str]:
    """The profiles that ship with splitserve, by name."""
    folder = importlib.resources.files(PROFILES_PACKAGE)
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in folder.iterdir()
        if entry.name.endswith(".yaml")
    )


def load_profile(name_or_path: str) -> LatencyProfile:
    """A profile file, or a shipped profile by name (``h100-llama-3.1-8b-tp1``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.exists():
            raise FileNotFoundError(f"latency profile {name_or_path!r} does not exist")
        text = path.read_text()
    else:
        resource = importlib.resources.files(PROFILES_PACKAGE) / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ValueError(
                f"no shipped latency profile {name_or_path!r}; shipped:"
                f" {', '.join(shipped_profiles()) or 'none'}; or give a profile file's path"
            )
        text = resource.read_text()
    return _parsed(text).model_copy()


@functools.lru_cache(maxsize=64)
def _parsed(text: str) -> LatencyProfile:
    # An offline cluster of 64 engines reads the same file 64 times; YAML parsing is
    # the slow part (15 ms each).
    return LatencyProfile.model_validate(yaml.safe_load(text))
