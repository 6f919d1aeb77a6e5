"""What one run is: endpoint, workload, arrivals, limits, targets. Validated up front.

Errors name the field and the allowed values, before anything is sent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from loadgen.burstgpt import BURSTGPT_URL, REPLAY_SUBSET, TRACE_SUBSETS
from splitserve.config_base import StrictModel
from splitserve.registry import Registry

# Workloads by name (loadgen/workloads.py registers the built-in ones: the study's
# synthetic shapes, custom, mixed and the BurstGPT subsets) and arrival processes by
# name (loadgen/arrivals.py). A new one is a class and a register line there.
WORKLOADS: Registry = Registry(
    "workload", __name__, builtins=("loadgen.workloads", "loadgen.recorded")
)
ARRIVALS: Registry = Registry("arrival process", __name__, builtins=("loadgen.arrivals",))
CUSTOM_WORKLOAD = "custom"
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
            return f"custom-{self.input_len}x{self.output_len}"
        if self.is_trace and self.trace == "burstgpt-synthetic":
            return f"{self.name} (synthetic)"
        return self.name


class RunConfig(StrictModel):
    """One run: one workload at one rate against one endpoint."""

    base_url: str = DEFAULT_BASE_URL
    endpoint: Literal["completions", "chat"] = "completions"
    model: str | None = Field(None, description="default: the first model of GET /v1/models")
    max_model_len: int | None = Field(None, gt=0, description="default: from GET /v1/models")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    qps: float = Field(math.inf, gt=0, description="requests/s; inf sends as fast as allowed")
    arrival_process: str = Field("poisson", description="a registered arrival process")
    burstiness: float = Field(
        1.0, gt=0, description="gamma arrivals: the gaps' shape; 1 is Poisson, below 1 burstier"
    )
    max_concurrency: int | None = Field(None, gt=0)
    num_requests: int = Field(STUDY_REQUESTS_PER_CELL, gt=0)
    warmup_requests: int = Field(DEFAULT_WARMUP_REQUESTS, ge=0)
    seed: int = 0
    connect_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(300.0, gt=0)
    request_timeout_s: float = Field(1800.0, gt=0)
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    mode: str | None = Field(None, description="label: tp, pp, dp, pd...; default: the router's")
    run_name: str | None = None
    prometheus_url: str | None = None
    server_metrics: bool = True
    server_sample_interval_s: float = Field(0.5, gt=0)
    temperature: float = Field(0.0, ge=0)
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
