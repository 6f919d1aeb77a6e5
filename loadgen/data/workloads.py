"""What each request asks for: prompt and output lengths, and the prompts themselves.

Synthetic workloads (the study's Table 2): ``general`` 1024→128, ``prefill-heavy``
2048→32, ``decode-heavy`` 128→512, or ``custom`` lengths with an optional spread.
Trace workloads: the BurstGPT subsets of ``loadgen.data.burstgpt``, from the real file or
its BurstGPT-shaped stand-in.

Prompts: on ``/v1/completions`` a prompt is a list of random token ids (0-255 by
default: bytes on a byte-level tokenizer, ordinary tokens on BPE ones), so its length
is exact by construction. On ``/v1/chat/completions`` it is random text sized by a
calibration against the server's own count (``usage.prompt_tokens``), including the
chat template's overhead; every request's reported count is kept to check it.

Every random draw comes from ``--seed`` through independent streams, so the lengths
do not change when, say, the warm-up count does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from loadgen.config import CUSTOM_WORKLOAD, MULTI_TURN_WORKLOAD, WORKLOADS, WorkloadConfig
from loadgen.data.burstgpt import (
    REPLAY_SUBSET,
    TRACE_SUBSETS,
    BurstGPTShapedGenerator,
    BurstGPTTrace,
    filter_trace,
    read_trace_csv,
    replay_window,
    resolve_trace_file,
    trace_subset,
)

PROMPT_TOKEN_LOW = 0
PROMPT_TOKEN_HIGH = 256  # exclusive: the byte range
TEXT_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
WORD_LENGTH = 6  # a space every few letters keeps BPE tokenizers near one token per word piece
SYNTHETIC_TRACE_SEED = 0  # the stand-in trace is a fixed data set; --seed picks rows from it
# Independent random streams derived from --seed, by purpose.
LENGTHS_STREAM, WARMUP_STREAM, TOKENS_STREAM, TEXT_STREAM, ARRIVALS_STREAM = range(5)


@dataclass(frozen=True)
class RequestSize:
    input_len: int
    output_len: int
    # Names of the prefix blocks the prompt starts with (a recorded request's salted
    # block hashes, a vLLM dataset's shared prefix): equal names, equal tokens.
    prefix: tuple[str, ...] = ()
    text: str | None = None  # a dataset's own prompt, sent as it is


@dataclass(frozen=True)
class WorkloadPlan:
    """The requests of one run, in sending order, plus the warm-up ones."""

    name: str
    label: str
    sizes: list[RequestSize]
    warmup_sizes: list[RequestSize]
    source: str
    synthetic_trace: bool = False
    trace_arrivals: list[float] | None = None  # replays: the trace's own seconds
    prefix_block_tokens: int | None = None  # recorded replays: tokens per prefix block

    def mean_lengths(self) -> tuple[float, float]:
        if not self.sizes:
            return (0.0, 0.0)
        return (
            float(np.mean([s.input_len for s in self.sizes])),
            float(np.mean([s.output_len for s in self.sizes])),
        )


def seed_stream(seed: int, stream: int) -> np.random.Generator:
    """The ``stream``-th independent generator derived from ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(stream + 1)[stream])


def arrival_seed(seed: int) -> int:
    """An integer seed for the arrival process, independent of the length draws."""
    return int(seed_stream(seed, ARRIVALS_STREAM).integers(2**63 - 1))


class WorkloadKind(Protocol):
    """A registered workload (``--workload NAME``): lays out a run's request lengths."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan: ...


@dataclass(frozen=True)
class LengthDraws:
    """What a workload draws from: the run's counts, its random streams, the context."""

    num_requests: int
    warmup_requests: int
    main_rng: np.random.Generator
    warmup_rng: np.random.Generator
    max_model_len: int
    seed: int = 0  # for draws that repeat another client's (vLLM's datasets) exactly


def plan_workload(
    config: WorkloadConfig,
    num_requests: int,
    warmup_requests: int,
    seed: int,
    max_model_len: int,
) -> WorkloadPlan:
    """Lengths for every request of a run (and its warm-up), reproducible from ``seed``."""
    draws = LengthDraws(
        num_requests,
        warmup_requests,
        seed_stream(seed, LENGTHS_STREAM),
        seed_stream(seed, WARMUP_STREAM),
        max_model_len,
        seed,
    )
    kind = WORKLOADS.get(config.name)
    return kind.plan(config, draws)


@dataclass(frozen=True)
class FixedLengths:
    """Every request ``input_len`` -> ``output_len`` tokens (``custom``: the config's
    lengths, spread uniformly by ``spread``)."""

    input_len: int | None = None
    output_len: int | None = None

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        input_len = self.input_len or config.input_len
        output_len = self.output_len or config.output_len
        assert input_len is not None and output_len is not None
        if config.prefix_len + input_len + output_len > draws.max_model_len:
            raise ValueError(
                f"{config.label}: {config.prefix_len + input_len} + {output_len} tokens"
                f" exceed the server's context of {draws.max_model_len}"
            )
        if config.input_range_ratio is not None or config.output_range_ratio is not None:
            sizes = _vllm_random_sizes(config, draws, input_len, output_len)
            warmups = _synthetic_sizes(
                draws.warmup_rng, draws.warmup_requests, input_len, output_len, 0.0
            )
        else:
            spread = config.spread
            sizes = _synthetic_sizes(
                draws.main_rng, draws.num_requests, input_len, output_len, spread
            )
            warmups = _synthetic_sizes(
                draws.warmup_rng, draws.warmup_requests, input_len, output_len, spread
            )
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=_with_shared_prefix(sizes, config.prefix_len, SHARED_PREFIX),
            # Warm-ups get a prefix of their own: they must not put the measured one in
            # the server's prefix cache.
            warmup_sizes=_with_shared_prefix(warmups, config.prefix_len, WARMUP_PREFIX),
            source="synthetic",
            prefix_block_tokens=config.prefix_len or None,
        )


SHARED_PREFIX = "shared-prefix"
WARMUP_PREFIX = "warmup-prefix"


def _with_shared_prefix(sizes: list[RequestSize], prefix_len: int, name: str) -> list[RequestSize]:
    """Every prompt starts with the same ``prefix_len`` tokens (vLLM's random prefix)."""
    if not prefix_len:
        return sizes
    return [RequestSize(s.input_len + prefix_len, s.output_len, (name,)) for s in sizes]


def _vllm_random_sizes(
    config: WorkloadConfig, draws: LengthDraws, input_len: int, output_len: int
) -> list[RequestSize]:
    """Lengths as vLLM's random dataset draws them (``get_sampling_params``): integers
    uniform in [floor(L(1-r)), ceil(L(1+r))], prompts first, from ``default_rng(seed)``;
    the same ``--seed`` gives the same lengths as vLLM's client (for a tokenizer that
    adds no special tokens: vLLM takes those off the prompt's length)."""
    input_ratio = config.input_range_ratio or 0.0
    output_ratio = config.output_range_ratio or 0.0
    input_low = math.floor(input_len * (1 - input_ratio))
    input_high = math.ceil(input_len * (1 + input_ratio))
    output_low = max(math.floor(output_len * (1 - output_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + output_ratio)), 1)
    if config.prefix_len + input_low < 1:
        raise ValueError(f"{config.label}: the shortest prompt would have no token")
    if config.prefix_len + input_high + output_high > draws.max_model_len:
        raise ValueError(
            f"{config.label}: the longest request, {config.prefix_len + input_high} +"
            f" {output_high} tokens, exceeds the server's context of {draws.max_model_len}"
        )
    rng = np.random.default_rng(draws.seed)
    inputs = rng.integers(input_low, input_high + 1, size=draws.num_requests)
    outputs = rng.integers(output_low, output_high + 1, size=draws.num_requests)
    return [RequestSize(int(i), int(o)) for i, o in zip(inputs, outputs, strict=True)]


@dataclass(frozen=True)
class MixedClasses:
    """Each request one of ``classes`` (input, output, share), drawn by share."""

    classes: tuple[tuple[int, int, float], ...]

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=self._sizes(draws.main_rng, draws.num_requests, draws.max_model_len),
            warmup_sizes=self._sizes(draws.warmup_rng, draws.warmup_requests, draws.max_model_len),
            source="synthetic",
        )

    def _sizes(self, rng: np.random.Generator, count: int, max_len: int) -> list[RequestSize]:
        shares = np.array([share for _, _, share in self.classes])
        picks = rng.choice(len(self.classes), size=count, p=shares / shares.sum())
        sizes = [RequestSize(*self.classes[i][:2]) for i in picks]
        too_long = [s for s in sizes if s.input_len + s.output_len > max_len]
        if too_long:
            raise ValueError(
                f"mixed: {too_long[0].input_len} + {too_long[0].output_len} tokens exceed the"
                f" server's context of {max_len}"
            )
        return sizes


def _synthetic_sizes(
    rng: np.random.Generator, count: int, input_len: int, output_len: int, spread: float
) -> list[RequestSize]:
    inputs = _spread_lengths(rng, count, input_len, spread)
    outputs = _spread_lengths(rng, count, output_len, spread)
    return [RequestSize(int(i), int(o)) for i, o in zip(inputs, outputs, strict=True)]


def _spread_lengths(rng: np.random.Generator, count: int, length: int, spread: float) -> np.ndarray:
    if spread == 0:
        return np.full(count, length, dtype=np.int64)
    low = max(1, round(length * (1 - spread)))
    high = max(low, round(length * (1 + spread)))
    return rng.integers(low, high + 1, size=count)


# ---- trace workloads ---------------------------------------------------------------------


def load_trace(config: WorkloadConfig) -> BurstGPTTrace:
    """The filtered trace a config names: real (file, cache, download) or BurstGPT-shaped."""
    if config.trace == "burstgpt-synthetic":
        trace = _synthetic_trace(SYNTHETIC_TRACE_SEED, config.synthetic_trace_rows)
    else:
        path = resolve_trace_file(config.trace_file, config.trace_cache_dir, config.trace_url)
        trace = _read_trace_cached(path.resolve(), path.stat().st_mtime_ns)
    models = tuple(config.trace_models or ())
    log_types = tuple(config.trace_log_types or ())
    return filter_trace(trace, list(models), list(log_types))


@functools.lru_cache(maxsize=2)
def _read_trace_cached(path: Path, _mtime_ns: int) -> BurstGPTTrace:
    # A sweep reads the same 1.4 M-row file for every cell: parse it once.
    return read_trace_csv(path)


@functools.lru_cache(maxsize=2)
def _synthetic_trace(seed: int, rows: int) -> BurstGPTTrace:
    return BurstGPTShapedGenerator(seed=seed).generate(rows)


class TraceSubset:
    """Requests sampled from one BurstGPT subset's rows (``T-general``, ...)."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        trace = load_trace(config)
        subset = trace_subset(trace, config.name, draws.max_model_len)
        if not len(subset):
            raise ValueError(f"{config.name}: no row of {trace.source} fits its rule")
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=_trace_sizes(_sample_rows(subset, draws.main_rng, draws.num_requests)),
            warmup_sizes=_trace_sizes(
                _sample_rows(subset, draws.warmup_rng, draws.warmup_requests)
            ),
            source=trace.source,
            synthetic_trace=trace.synthetic,
        )


class TraceReplay:
    """A window of the trace in its own order, with its own arrival times."""

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        trace = load_trace(config)
        window = replay_window(trace, config.trace_start, draws.num_requests, draws.max_model_len)
        sizes = _trace_sizes(window)
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=sizes,
            warmup_sizes=sizes[: draws.warmup_requests],
            source=trace.source,
            synthetic_trace=trace.synthetic,
            trace_arrivals=window.timestamps.tolist(),
        )


def _sample_rows(trace: BurstGPTTrace, rng: np.random.Generator, count: int) -> BurstGPTTrace:
    rows = rng.choice(len(trace), size=count, replace=count > len(trace))
    return trace.select(rows)


def _trace_sizes(trace: BurstGPTTrace) -> list[RequestSize]:
    return [
        RequestSize(int(i), int(o))
        for i, o in zip(trace.request_tokens, trace.response_tokens, strict=True)
    ]


@dataclass(frozen=True)
class MultiTurnChat:
    """Conversations whose history grows: every turn's prompt is the shared system
    prompt (``prefix_len`` tokens, rounded up to whole turns), then the conversation's
    earlier turns, then ``input_len`` new tokens; it asks for ``output_len``. The
    ``conversations`` take turns (request i is turn i // C of conversation i % C), so a
    turn is sent C requests after the one before it, whose answer is usually done by
    then; a conversation that would outgrow the context starts over as a new one.

    An earlier turn stands in the history as a block of its own tokens, not as the
    user's words and the server's answer: the load generator sends a schedule, not a
    dialogue. So each turn can reuse from the prefix cache the system prompt and every
    turn before the last, and the cached part grows with the conversation, which is
    what the router's prefix signals and PD's prefill decisions are to be tested on.
    Token-id prompts: ``/v1/completions`` only.
    """

    def plan(self, config: WorkloadConfig, draws: LengthDraws) -> WorkloadPlan:
        assert config.input_len is not None and config.output_len is not None
        turn = config.input_len + config.output_len  # what a past turn adds to the history
        system_blocks = -(-config.prefix_len // turn)  # the system prompt, in turn-sized blocks
        room = draws.max_model_len - config.input_len - config.output_len
        turns = room // turn - system_blocks + 1  # a conversation's turns before it restarts
        if turns < 1:
            raise ValueError(
                f"{config.label}: the system prompt and one turn exceed the server's context"
                f" of {draws.max_model_len} tokens"
            )
        return WorkloadPlan(
            name=config.name,
            label=config.label,
            sizes=self._turns(config, draws.num_requests, turn, system_blocks, turns, "chat"),
            # Conversations of their own: warm-ups must not cache the measured history.
            warmup_sizes=self._turns(
                config, draws.warmup_requests, turn, system_blocks, turns, "warmup"
            ),
            source="synthetic",
            prefix_block_tokens=turn,
        )

    @staticmethod
    def _turns(
        config: WorkloadConfig, count: int, turn: int, system_blocks: int, turns: int, name: str
    ) -> list[RequestSize]:
        """``count`` requests: ``turn`` tokens a past turn, ``turns`` turns a conversation."""
        assert config.input_len is not None and config.output_len is not None
        system = tuple(f"{name}-system-{block}" for block in range(system_blocks))
        sizes = []
        for index in range(count):
            conversation, nth = index % config.conversations, index // config.conversations
            generation, at = divmod(nth, turns)
            history = tuple(f"{name}-{conversation}.{generation}-turn-{t}" for t in range(at))
            prefix = system + history
            input_len = len(prefix) * turn + config.input_len
            sizes.append(RequestSize(input_len, config.output_len, prefix))
        return sizes


# ---- the built-in workloads ----------------------------------------------------------------

# The study's Table 2 sizes (input, output tokens).
SYNTHETIC_WORKLOADS: dict[str, tuple[int, int]] = {
    "general": (1024, 128),
    "prefill-heavy": (2048, 32),
    "decode-heavy": (128, 512),
}
# Short chat turns among long documents: the mix where prefilling every prompt remotely
# (or none) is wrong for part of the traffic. (input, output, share of requests).
MIXED_CLASSES: tuple[tuple[int, int, float], ...] = ((128, 128, 0.7), (2048, 32, 0.3))
for _name, (_input, _output) in SYNTHETIC_WORKLOADS.items():
    WORKLOADS.register(_name)(FixedLengths(_input, _output))
WORKLOADS.register("mixed")(MixedClasses(MIXED_CLASSES))
WORKLOADS.register(CUSTOM_WORKLOAD)(FixedLengths())
WORKLOADS.register(MULTI_TURN_WORKLOAD)(MultiTurnChat())
for _name in TRACE_SUBSETS:
    WORKLOADS.register(_name)(TraceReplay() if _name == REPLAY_SUBSET else TraceSubset())


# ---- prompts -------------------------------------------------------------------------------


class TokenPrompts:
    """Random token-id prompts of exact length (``/v1/completions``)."""

    def __init__(self, seed: int, low: int = PROMPT_TOKEN_LOW, high: int = PROMPT_TOKEN_HIGH):
        self._rng = seed_stream(seed, TOKENS_STREAM)
        self._low = low
        self._high = high

    def prompt(self, length: int) -> list[int]:
        return self._rng.integers(self._low, self._high, size=length).tolist()


@dataclass(frozen=True)
class TextCalibration:
    """Server tokens for ``chars`` characters of our text: overhead + chars * per_char."""

    overhead_tokens: float = 0.0
    tokens_per_char: float = 1.0

    def chars_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.overhead_tokens) / self.tokens_per_char))

    @classmethod
    def from_probes(cls, short: tuple[int, int], long: tuple[int, int]) -> TextCalibration:
        """Two (characters, reported prompt tokens) probes define the line."""
        (short_chars, short_tokens), (long_chars, long_tokens) = short, long
        per_char = (long_tokens - short_tokens) / (long_chars - short_chars)
        if per_char <= 0:
            return cls()
        return cls(short_tokens - short_chars * per_char, per_char)


class TextPrompts:
    """Random lower-case text whose token count is calibrated (``/v1/chat/completions``)."""

    def __init__(self, seed: int, calibration: TextCalibration | None = None) -> None:
        self._rng = seed_stream(seed, TEXT_STREAM)
        self.calibration = calibration or TextCalibration()

    def text(self, chars: int) -> str:
        letters = TEXT_ALPHABET[self._rng.integers(0, len(TEXT_ALPHABET), size=chars)].copy()
        letters[WORD_LENGTH :: WORD_LENGTH + 1] = ord(" ")
        return letters.tobytes().decode()

    def prompt(self, length: int) -> str:
        return self.text(self.calibration.chars_for(length))
