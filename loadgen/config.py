"""What one run is: endpoint, workload, arrivals, limits, targets. Validated up front.

Errors name the field and the allowed values, before anything is sent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from loadgen.data.burstgpt import BURSTGPT_URL, REPLAY_SUBSET, TRACE_SUBSETS
from splitserve.config_base import StrictModel
from splitserve.registry import Registry

if TYPE_CHECKING:  # both modules import this one for its settings
    from loadgen.data.workloads import WorkloadKind
    from loadgen.scheduling.arrivals import RateArrivals

# Workloads by name (loadgen/data/workloads.py registers the built-in ones: the study's
# synthetic shapes, custom, mixed and the BurstGPT subsets) and arrival processes by
# name (loadgen/scheduling/arrivals.py). A new one is a class and a register line there.
WORKLOADS: Registry[WorkloadKind] = Registry(
    "workload",
    __name__,
    builtins=("loadgen.data.workloads", "loadgen.data.recorded", "loadgen.vllm_compat.datasets"),
)
ARRIVALS: Registry[type[RateArrivals]] = Registry(
    "arrival process", __name__, builtins=("loadgen.scheduling.arrivals",)
)
CUSTOM_WORKLOAD = "custom"
PREFIX_REPETITION_WORKLOAD = "prefix-repetition"
PROMPT_FILE_WORKLOAD = "prompt-file"
MULTI_TURN_WORKLOAD = "multi-turn"
TraceSource = Literal["burstgpt", "burstgpt-synthetic", "recorded"]
STUDY_REQUESTS_PER_CELL = 200
DEFAULT_WARMUP_REQUESTS = 2
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class WorkloadConfig(StrictModel):
    """Which requests: a synthetic shape, a custom one, or a subset of the BurstGPT trace."""

    name: str = Field("general", description="a registered workload (loadgen.config.WORKLOADS)")
    input_len: int | None = Field(None, gt=0, description="custom: prompt tokens")
    output_len: int | None = Field(None, gt=0, description="custom: output tokens")
    spread: float = Field(
        0.0, ge=0.0, lt=1.0, description="custom: lengths uniform in L*(1 +- spread)"
    )
    input_range_ratio: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,
        description="custom, as vLLM's --random-range-ratio: prompt lengths uniform in"
        " [floor(L*(1-r)), ceil(L*(1+r))], drawn as vLLM's random dataset draws them",
    )
    output_range_ratio: float | None = Field(
        None, ge=0.0, lt=1.0, description="the same for output lengths"
    )
    prefix_len: int = Field(
        0,
        ge=0,
        description="custom: tokens of one prefix every prompt starts with (vLLM's"
        " --random-prefix-len, on top of input_len); prefix-repetition: each prefix's;"
        " multi-turn: the system prompt every conversation starts with",
    )
    suffix_len: int | None = Field(None, gt=0, description="prefix-repetition: tokens after it")
    num_prefixes: int = Field(1, gt=0, description="prefix-repetition: distinct prefixes")
    conversations: int = Field(
        8, gt=0, description="multi-turn: conversations, whose turns take turns"
    )
    prompt_file: Path | None = Field(
        None, description='prompt-file: JSONL, one {"prompt": ..., "output_tokens": ...} a line'
    )
    shuffle: bool = Field(True, description="prompt-file, prefix-repetition: shuffle the rows")
    oversample: bool = Field(True, description="prompt-file: repeat rows up to the count")
    trace: TraceSource = "burstgpt"
    trace_file: Path | None = None
    trace_cache_dir: Path | None = None
    trace_url: str = Field(BURSTGPT_URL, description="where a missing trace is downloaded from")
    trace_models: list[str] | None = Field(None, description="e.g. ChatGPT, GPT-4")
    trace_log_types: list[str] | None = Field(None, description="e.g. 'Conversation log'")
    trace_start: int = Field(0, ge=0, description="T-burst-replay: first row of the window")
    time_scale: float = Field(1.0, gt=0, description="T-burst-replay: 0.5 = twice as fast")
    synthetic_trace_rows: int = Field(200_000, gt=0)

    @field_validator("name")
    @classmethod
    def _known_name(cls, name: str) -> str:
        return WORKLOADS.check(name)

    @model_validator(mode="after")
    def _custom_has_lengths(self) -> WorkloadConfig:
        if self.name == CUSTOM_WORKLOAD and (self.input_len is None or self.output_len is None):
            raise ValueError("the custom workload needs both input_len and output_len")
        ranged = self.input_range_ratio is not None or self.output_range_ratio is not None
        if ranged and self.spread:
            raise ValueError("give spread or range ratios, not both")
        if self.name == PREFIX_REPETITION_WORKLOAD and (
            self.suffix_len is None or self.output_len is None or not self.prefix_len
        ):
            raise ValueError("prefix-repetition needs prefix_len, suffix_len and output_len")
        if self.name == PROMPT_FILE_WORKLOAD and self.prompt_file is None:
            raise ValueError("the prompt-file workload needs prompt_file")
        if self.name == MULTI_TURN_WORKLOAD and (self.input_len is None or self.output_len is None):
            raise ValueError("multi-turn needs input_len (a user turn) and output_len (an answer)")
        return self

    @property
    def is_trace(self) -> bool:
        return self.name in TRACE_SUBSETS

    @property
    def is_replay(self) -> bool:
        return self.name in (REPLAY_SUBSET, "recorded-replay")

    @property
    def label(self) -> str:
        if self.name == CUSTOM_WORKLOAD:
            prefix = f"{self.prefix_len}+" if self.prefix_len else ""
            return f"custom-{prefix}{self.input_len}x{self.output_len}"
        if self.name == PREFIX_REPETITION_WORKLOAD:
            return (
                f"prefix-repetition-{self.num_prefixes}x{self.prefix_len}"
                f"+{self.suffix_len}x{self.output_len}"
            )
        if self.name == PROMPT_FILE_WORKLOAD and self.prompt_file is not None:
            return f"prompts-{self.prompt_file.stem}"
        if self.name == MULTI_TURN_WORKLOAD:
            system = f"{self.prefix_len}+" if self.prefix_len else ""
            return f"multi-turn-{self.conversations}x{system}{self.input_len}x{self.output_len}"
        if self.is_trace and self.trace == "burstgpt-synthetic":
            return f"{self.name} (synthetic)"
        return self.name


class RampUpConfig(StrictModel):
    """vLLM's --ramp-up-strategy: the rate grows from start to end over the requests."""

    strategy: Literal["linear", "exponential"]
    start_rps: float = Field(gt=0, description="the first request's rate")
    end_rps: float = Field(gt=0, description="the last request's rate")

    @model_validator(mode="after")
    def _grows(self) -> RampUpConfig:
        if self.start_rps > self.end_rps:
            raise ValueError("the ramp-up's start rate must not exceed its end rate")
        return self

    @property
    def label(self) -> str:
        return f"ramp-{self.strategy}-{self.start_rps:g}-{self.end_rps:g}"


class RunConfig(StrictModel):
    """One run: one workload at one rate against one endpoint."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: Literal["completions", "chat"] = "completions"
    endpoint_path: str | None = Field(
        None, description="the URL path, when not /v1/completions or /v1/chat/completions"
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="sent with every request, after Authorization from $OPENAI_API_KEY",
    )
    verify_tls: bool = True
    ready_timeout_s: float = Field(
        0.0, ge=0, description="wait this long for GET /v1/models to answer (0: ask once)"
    )
    model: str | None = Field(None, description="default: the first model of GET /v1/models")
    max_model_len: int | None = Field(None, gt=0, description="default: from GET /v1/models")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    qps: float = Field(math.inf, gt=0, description="requests/s; inf sends as fast as allowed")
    arrival_process: str = Field("poisson", description="a registered arrival process")
    burstiness: float = Field(
        1.0, gt=0, description="gamma arrivals: the gaps' shape; 1 is Poisson, below 1 burstier"
    )
    max_concurrency: int | None = Field(None, gt=0)
    engine_time_scale: float = Field(
        1.0,
        gt=0,
        description="the server's simulated engines run this many times slower"
        " (engine.time_scale): arrivals are spread by it and every latency divided by it,"
        " so the run reports the simulated fleet's own time",
    )
    num_requests: int = Field(STUDY_REQUESTS_PER_CELL, gt=0)
    warmup_requests: int = Field(DEFAULT_WARMUP_REQUESTS, ge=0)
    seed: int = 0
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(1800.0, gt=0)
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    slo_e2el_ms: float | None = Field(None, gt=0)
    ramp_up: RampUpConfig | None = Field(
        None, description="a growing rate instead of qps (which must then be inf)"
    )
    shape: str | None = Field(None, description="label: tp, pp, dp, pd...; default: the router's")
    run_name: str | None = None
    prometheus_url: str | None = None
    server_metrics: bool = True
    server_sample_interval_s: float = Field(0.5, gt=0)
    temperature: float | None = Field(0.0, ge=0, description="None: the server's default")
    ignore_eos: bool = Field(True, description="exact output lengths")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="more request body fields (sampling, --extra-body)"
    )
    request_id_prefix: str | None = Field(
        None, description="send x-request-id: <prefix><index> with each measured request"
    )
    lora_modules: list[str] | None = Field(
        None, description="model names to spread the measured requests over"
    )
    lora_assignment: Literal["random", "round-robin"] = "random"
    return_token_ids: bool = True
    show_progress: bool = True

    @field_validator("arrival_process")
    @classmethod
    def _known_process(cls, name: str) -> str:
        return ARRIVALS.check(name)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, not {url!r}")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _ramp_up_replaces_rate(self) -> RunConfig:
        if self.ramp_up is not None and math.isfinite(self.qps):
            raise ValueError("a ramp-up sets the rate itself: leave qps at inf")
        return self
