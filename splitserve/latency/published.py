"""Public vLLM serving runs that the GPU profiles are fitted on and checked against.

``public_runs/runs.yaml`` holds each run as its source printed it (the summary of
``benchmark_serving.py`` or ``vllm bench serve``, or a README's table), with the source,
vLLM version and engine settings; ``public_runs/lambda_requests.jsonl`` holds the
per-request prompt and output lengths of the LambdaLabsML/vllm-benchmark result files,
so that a replay sends what they sent. ``public_runs/SOURCES.md`` says what was read and
what was left out.

A run is either in the calibration set (profiles are fitted on it) or held out (never
fitted on; only its replay's error is reported): ``CALIBRATION`` below names the
calibration set, everything else replayable is held out.

What a replay needs of a run, ``ReplaySpec``: the profile it runs on (device, model,
TP), vLLM's scheduler settings, and the requests (lengths, arrival times).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import random
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

PUBLISHED_PACKAGE = "splitserve.latency.public_runs"
Figure = Literal["ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s"]
FIGURES: tuple[Figure, ...] = ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s")

# The runs the profiles are fitted on, by id: per device, the two ends of the load range
# (10 prompts: a small batch; 320: a saturated engine) of 8B on one device and of 70B
# FP8 on four. Every other run that can be replayed is held out: the loads between
# (20-160 prompts), other TP degrees (FP8 on two and eight), 70B at BF16, and Poisson
# arrivals from another client (SGLang's), on lengths this set did not publish.
CALIBRATION: tuple[str, ...] = (
    "lambda-h100x1-llama3-8b-tp1-sharegpt-n10-inf",
    "lambda-h100x1-llama3-8b-tp1-sharegpt-n320-inf",
    "lambda-h100x4-llama31-70b-fp8-tp4-sharegpt-n10-inf",
    "lambda-h100x4-llama31-70b-fp8-tp4-sharegpt-n320-inf",
    "lambda-a100x1-llama3-8b-tp1-sharegpt-n10-inf",
    "lambda-a100x1-llama3-8b-tp1-sharegpt-n320-inf",
    "lambda-a100x4-llama31-70b-fp8-tp4-sharegpt-n10-inf",
    "lambda-a100x4-llama31-70b-fp8-tp4-sharegpt-n320-inf",
)

# The catalog's device and model (splitserve/latency/catalog.py) of a run's device and
# checkpoint. SXM is assumed where a source says only "80GB" (SGLang's README): both
# Lambda's and SGLang's machines are 8-GPU servers, which are SXM.
DEVICES = {
    "H100-SXM-80GB": "h100",
    "H100-80GB (SXM/PCIe not stated)": "h100",
    "A100-SXM-80GB": "a100",
    "A100-80GB (SXM/PCIe not stated)": "a100",
}
# Llama 3 and 3.1 share their shapes at 8B and at 70B (config.json); 3.1 only adds
# RoPE scaling for longer contexts, which these runs' 2-4K contexts never reach.
MODELS = {
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8": "llama-3.1-70b-fp8",
}
# Requests a replay of a Poisson run sends: the published run's count is 1,200-2,400,
# and the medians settle well before that; a replay that takes as long as the run
# (minutes of virtual time) would make a fit of many replays slow.
POISSON_REQUESTS = 600


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RunEngine(_Loose):
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    num_scheduler_steps: int | None = None
    max_model_len: int | None = None
    other: dict[str, Any] = {}


class RunWorkload(_Loose):
    dataset: str
    num_prompts: int
    request_rate: float | str
    input_len: float | None = None
    output_len: float | None = None


class RunResults(_Loose):
    duration_s: float | None = None
    total_input_tokens: int | None = None
    total_output_tokens: int | None = None
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = None
    output_throughput: float | None = None


class PublishedRun(_Loose):
    id: str
    source: str
    vllm_version: str | None = None
    device: str
    model: str
    dtype: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine: RunEngine
    workload: RunWorkload
    results: RunResults
    notes: str = ""

    @property
    def figures(self) -> dict[Figure, float]:
        """The run's published figures that a replay is compared on."""
        results = self.results
        found: dict[Figure, float | None] = {
            "ttft_p50_ms": results.median_ttft_ms,
            "tpot_p50_ms": results.median_tpot_ms,
            "output_tokens_per_s": results.output_throughput,
        }
        return {name: value for name, value in found.items() if value is not None}

    @property
    def version(self) -> str | None:
        return self.vllm_version or self.engine.other.get("inferred_vllm_version")

    @property
    def scheduler_steps(self) -> int | None:
        steps = self.engine.num_scheduler_steps
        return steps or self.engine.other.get("inferred_num_scheduler_steps")


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    at: float  # seconds from the run's start
    prompt_tokens: int
    max_tokens: int
    # The client saw no token (the model's first was its end): benchmark_serving counts
    # its TTFT as 0 and its TPOT not at all.
    silent: bool = False
    # Its own TTFT in the published run (seconds), where the run published each one's.
    ttft: float | None = None


@dataclass(frozen=True, slots=True)
class ReplaySpec:
    """What a replay of one run serves, and on what."""

    run: PublishedRun
    device: str  # the catalog's
    model: str  # the catalog's
    engine_kwargs: dict[str, Any]
    max_model_len: int
    requests: tuple[ReplayRequest, ...]
    # How the requests were known: "published" (the run's own lengths) or "sampled"
    # (the run's dataset, from another run's lengths).
    lengths: str

    @property
    def set(self) -> str:
        return "calibration" if self.run.id in CALIBRATION else "held-out"


def published_runs() -> list[PublishedRun]:
    document = yaml.safe_load(_resource("runs.yaml"))
    return [PublishedRun.model_validate(run) for run in document["runs"]]


def replay_specs() -> list[ReplaySpec]:
    """Every run a replay can serve: a device and model the catalog has, and requests
    whose lengths are known or sampled from the same dataset."""
    specs = []
    for run in published_runs():
        spec = replay_spec(run)
        if spec is not None:
            specs.append(spec)
    return specs


def replay_spec(run: PublishedRun) -> ReplaySpec | None:
    device, model = DEVICES.get(run.device), MODELS.get(run.model)
    if device is None or model is None or not run.figures:
        return None
    requests, lengths = _requests(run)
    if not requests:
        return None
    return ReplaySpec(
        run=run,
        device=device,
        model=model,
        engine_kwargs=_engine_kwargs(run),
        max_model_len=run.engine.max_model_len or 2048,
        requests=tuple(requests),
        lengths=lengths,
    )


def _engine_kwargs(run: PublishedRun) -> dict[str, Any]:
    """vLLM's scheduler settings of the run, as a pool's engine_kwargs (the simulated
    backend reads num_scheduler_steps as V0's; engines/simulated/settings.py)."""
    engine = run.engine
    kwargs: dict[str, Any] = {
        # Lambda's report and SGLang's README: 256, V0's default.
        "max_num_seqs": engine.max_num_seqs or 256,
        "num_scheduler_steps": run.scheduler_steps or 1,
        "enable_chunked_prefill": bool(engine.enable_chunked_prefill),
    }
    if engine.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    return kwargs


def _requests(run: PublishedRun) -> tuple[list[ReplayRequest], str]:
    lambda_files = _lambda_requests()
    path = _lambda_path(run.source)
    if path is not None and path in lambda_files:
        return _lambda_replay(run, lambda_files[path]), "published"
    if run.workload.dataset == "sharegpt" and run.workload.request_rate != "inf":
        return _poisson_replay(run, float(run.workload.request_rate)), "sampled"
    return [], "unknown"


def _lambda_path(source: str) -> str | None:
    marker = "github.com/LambdaLabsML/vllm-benchmark "
    if not source.startswith(marker):
        return None
    return source.removeprefix(marker).split(" @ ")[0]


def _lambda_replay(run: PublishedRun, lengths: dict[str, Any]) -> list[ReplayRequest]:
    """Every request at once (rate inf), each with its prompt and what it generated:
    the runs did not ignore EOS, so a request's output length is where it stopped."""
    ttfts = lengths.get("ttfts") or [None] * len(lengths["input_lens"])
    return [
        ReplayRequest(0.0, prompt, max(1, output), silent=output == 0, ttft=ttft)
        for prompt, output, ttft in zip(
            lengths["input_lens"], lengths["output_lens"], ttfts, strict=True
        )
    ]


def _poisson_replay(run: PublishedRun, rate: float) -> list[ReplayRequest]:
    """ShareGPT requests at Poisson arrivals of the run's rate. The run's own lengths
    were not published; these are drawn from the 320 ShareGPT requests of Lambda's
    runs (same dataset and filter), each with its longest output across those runs:
    SGLang's client sends the dataset's output length and ignores EOS."""
    pairs = _sharegpt_pairs()
    rng = random.Random(run.id)
    count = min(run.workload.num_prompts, POISSON_REQUESTS)
    at, requests = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        prompt, output = pairs[rng.randrange(len(pairs))]
        requests.append(ReplayRequest(at, prompt, output))
    return requests


@functools.cache
def _sharegpt_pairs() -> list[tuple[int, int]]:
    files = [f for f in _lambda_requests().values() if f["num_prompts"] == 320]
    prompts = files[0]["input_lens"]
    outputs = [max(f["output_lens"][i] for f in files) for i in range(len(prompts))]
    return [(p, o) for p, o in zip(prompts, outputs, strict=True) if o > 0]


@functools.cache
def _lambda_requests() -> dict[str, dict[str, Any]]:
    lines = _resource("lambda_requests.jsonl").splitlines()
    return {item["path"]: item for item in map(json.loads, lines) if item}


def _resource(name: str) -> str:
    return (importlib.resources.files(PUBLISHED_PACKAGE) / name).read_text()
