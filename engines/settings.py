"""An engine's settings: the model it serves, its pool's shape, its backend, and the
whole spec one engine starts from (``EngineSpec``), as the application builder hands
it over. The YAML's ``model:``, ``pools:`` and ``engine:`` blocks validate into these.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from engines.protocol import EngineRole
from engines.vllm_args import (
    KVOffloadingBackend,
    engine_arg_names,
    reasoning_parser_names,
    tool_parser_names,
)
from kv_transfer.settings import KVTransferConfig
from splitserve.config_base import StrictModel

# Set in every engine process's environment to its replica's name (engine-0, prefill-0),
# so that tools can tell which processes belong to which engine.
ENGINE_NAME_ENV = "SPLITSERVE_ENGINE"
# vLLM's CPU backend: the cores an engine's ranks run on.
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


# vLLM engine arguments that splitserve sets from its own fields: in engine_kwargs they
# would silently override those fields, so they are refused, naming the field to use.
ENGINE_ARGS_SET_BY_FIELDS = {
    "model": "model.source",
    "served_model_name": "model.served_model_name",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "block_size": "model.block_size",
    "enforce_eager": "model.enforce_eager",
    "seed": "model.seed",
    "enable_prefix_caching": "model.enable_prefix_caching",
    "reasoning_parser": "model.reasoning_parser",
    "enable_lora": "model.lora_adapters or model.runtime_lora_updates",
    "max_loras": "model.max_loras",
    "max_lora_rank": "model.max_lora_rank",
    "tensor_parallel_size": "the pool's tensor_parallel_size",
    "pipeline_parallel_size": "the pool's pipeline_parallel_size",
    "gpu_memory_utilization": "the pool's gpu_memory_utilization",
    "kv_offloading_size": "the pool's kv_offloading_size",
    "kv_offloading_backend": "the pool's kv_offloading_backend",
    "kv_transfer_config": "shape and kv_transfer (the KV connector is set by them)",
    "kv_events_config": "router.prefix_signal",
    "disable_log_stats": "nothing: the router reads the engine's stats",
}


# Engine arguments of an older vLLM that the simulated backend replays (benchmarks run on
# it) and the installed vLLM may not have: taken here by name, and refused for other
# backends where the installed vLLM lacks them (deployments/config.py).
SIMULATED_ONLY_ENGINE_ARGS = {
    "num_scheduler_steps": "vLLM V0's multi-step scheduling (0.6.x), which V1 has not",
}


def check_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` if every name is an engine argument of vLLM's that no field of ours sets."""
    problems = []
    for name in sorted(kwargs):
        if name in ENGINE_ARGS_SET_BY_FIELDS:
            problems.append(f"{name!r} is set by {ENGINE_ARGS_SET_BY_FIELDS[name]}; use that")
        elif name in SIMULATED_ONLY_ENGINE_ARGS:
            continue
        elif name not in (known := engine_arg_names()):  # read only when there are names
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            problems.append(f"{name!r} is not one of vLLM's engine arguments{hint}")
    if problems:
        raise ValueError("engine_kwargs: " + "; ".join(problems))
    return kwargs


def member_name(pool_name: str, replica_id: str) -> str:
    """A scaled pool's engine: its pool's name and its Serve replica id (decode-a1b2c3d4)."""
    return f"{pool_name}-{replica_id}"


# The embedded tiny Llama; ``embedded:<seed>`` is a variant with other random weights,
# another model for a cluster that serves several.
EMBEDDED_SOURCE = "embedded"


def embedded_seed(source: str) -> int | None:
    """The weights' seed of an embedded source, or None for a folder or hub id."""
    if source == EMBEDDED_SOURCE:
        return 0
    name, colon, seed = source.partition(":")
    if name != EMBEDDED_SOURCE or not colon:
        return None
    if not seed.isdigit():
        raise ValueError(f"model.source {source!r}: an embedded variant is embedded:<seed>")
    return int(seed)


# A lora_adapters path that names the deterministic tiny adapter built locally for the
# embedded model (engines/tiny_lora.py), by seed: embedded-lora:<seed>.
EMBEDDED_LORA = "embedded-lora"


def embedded_lora_seed(path: str) -> int | None:
    name, colon, seed = path.partition(":")
    if name != EMBEDDED_LORA:
        return None
    if not colon or not seed.isdigit():
        raise ValueError(f"{path!r}: the embedded model's adapters are {EMBEDDED_LORA}:<seed>")
    return int(seed)


class LoraAdapterConfig(StrictModel):
    """One adapter, as ``vllm serve --lora-modules name=path`` names it."""

    name: str = Field(min_length=1, description="What clients send in 'model' to use it.")
    path: str = Field(
        description="A local folder (on every node that runs the model's engines), a"
        " Hugging Face id, or embedded-lora:<seed> (a tiny adapter built locally for the"
        " embedded model)."
    )

    @field_validator("path")
    @classmethod
    def _embedded_adapter(cls, path: str) -> str:
        embedded_lora_seed(path)
        return path


class ModelConfig(StrictModel):
    """Which weights to serve and how vLLM should hold them."""

    source: str = Field(
        EMBEDDED_SOURCE,
        description="'embedded' (the tiny offline Llama; 'embedded:<seed>' for a variant"
        " with other weights), a local folder, or a Hugging Face id.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients use in 'model'; defaults to the source's name."
    )
    dtype: str | None = Field(
        None,
        description="vLLM's dtype. Unset: float32 for the embedded model (its random"
        " weights give near-tied logits, and bf16 rounding would let TP/PP reductions flip"
        " greedy tokens), else 'auto', as vllm serve.",
    )
    max_model_len: int | None = Field(
        None, gt=0, description="The context length; unset: the model's own, as vllm serve."
    )
    block_size: int | None = Field(None, gt=0, description="KV block size; engine default if None.")
    enforce_eager: bool | None = Field(
        None,
        description="Run without CUDA graphs or torch.compile. Unset: true on CPUs (compiling"
        " costs more start-up than it saves on the embedded model), false on GPUs, as vllm"
        " serve.",
    )
    seed: int = 0
    enable_prefix_caching: bool = True
    # `vllm serve`'s per-model frontend flags, applied by the router's vLLM serving layer.
    chat_template: str | None = Field(
        None, description="A Jinja template (text or file) instead of the model's own."
    )
    enable_auto_tool_choice: bool = Field(
        False, description="tool_choice 'auto': parse tool calls out of the model's text."
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool parser for this model (e.g. hermes, llama3_json); named"
        " and required tool_choice need one, as with vllm serve.",
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM's reasoning parser for this model (e.g. deepseek_r1)."
    )
    lora_adapters: list[LoraAdapterConfig] = Field(
        default_factory=list,
        description="LoRA adapters served from the start, each by its name (vllm serve's"
        " --lora-modules); their engines run with LoRA enabled.",
    )
    runtime_lora_updates: bool = Field(
        False,
        description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind"
        " the API keys), as VLLM_ALLOW_RUNTIME_LORA_UPDATING allows them in vllm serve.",
    )
    max_loras: int | None = Field(
        None,
        gt=0,
        description="Adapters one engine batch may mix (vLLM's max_loras). Unset: as many"
        " as lora_adapters names, at least one, and one more on CPUs (vLLM's CPU LoRA"
        " kernels read slot -1 for a base-model request: the spare slot keeps it empty).",
    )
    max_lora_rank: int = Field(
        16, description="The highest adapter rank the engines accept (vLLM's max_lora_rank)."
    )

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_adapters) or self.runtime_lora_updates

    def loras_per_batch(self, accelerator: str) -> int:
        if self.max_loras is not None:
            return self.max_loras
        return max(1, len(self.lora_adapters)) + (1 if accelerator == "cpu" else 0)

    @model_validator(mode="after")
    def _adapters_named_once(self) -> ModelConfig:
        names = [adapter.name for adapter in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_adapters: names must differ, got {names}")
        if self.served_model_name in names:
            raise ValueError(f"lora_adapters: {self.served_model_name!r} names the model itself")
        return self

    @field_validator("source")
    @classmethod
    def _embedded_variant(cls, source: str) -> str:
        embedded_seed(source)
        return source

    @model_validator(mode="after")
    def _known_parsers(self) -> ModelConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enable_auto_tool_choice needs a tool_call_parser, as vllm serve's"
                " --enable-auto-tool-choice needs --tool-call-parser"
            )
        for field, value, names in (
            ("tool_call_parser", self.tool_call_parser, tool_parser_names),
            ("reasoning_parser", self.reasoning_parser, reasoning_parser_names),
        ):
            known = names() if value is not None else frozenset()
            if value is not None and known and value not in known:
                raise ValueError(
                    f"{field} {value!r} is not one of vLLM's: {', '.join(sorted(known))}"
                )
        return self

    @property
    def engine_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "float32" if embedded_seed(self.source) is not None else "auto"

    def eager_on(self, accelerator: str) -> bool:
        return self.enforce_eager if self.enforce_eager is not None else accelerator == "cpu"


class PlacementConfig(StrictModel):
    """Which Ray nodes a pool's replicas run on: nodes with these labels (``ray start
    --labels``) and enough of these custom resources (``ray start --resources``)."""

    node_labels: dict[str, str] = Field(
        default_factory=dict, description="e.g. {splitserve-pool: prefill}; every one must match."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom resources each replica takes, e.g. {prefill_node: 1}.",
    )

    @model_validator(mode="after")
    def _says_something(self) -> PlacementConfig:
        if not self.node_labels and not self.resources:
            raise ValueError("placement needs node_labels, resources or both")
        bad = {name: amount for name, amount in self.resources.items() if amount <= 0}
        if bad:
            raise ValueError(f"placement.resources must be positive amounts; got {bad}")
        reserved = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(self.resources))
        if reserved:
            raise ValueError(
                f"placement.resources names Ray's own {reserved}; use custom resource names"
            )
        return self


class PoolAutoscaling(StrictModel):
    """Ray Serve grows and shrinks the pool between ``min_replicas`` and
    ``max_replicas`` from what its engines measure of the SLOs: the time to first token
    against ``ttft_slo_s`` and the time per output token against ``tpot_slo_s``
    (engines/pool_scaling.py). The pool then runs as one Serve deployment whose
    replicas each host an engine; routers find them as Serve adds and removes them."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(ge=1)
    ttft_slo_s: float | None = Field(
        None, gt=0, description="The TTFT the pool is sized for; default: qos.ttft_slo_s."
    )
    tpot_slo_s: float = Field(
        0.05, gt=0, description="The time per output token the pool is sized for."
    )
    scale_up_at: float = Field(
        0.8,
        gt=0,
        description="Grow by one engine when the engines' mean share of an SLO (the worse of"
        " TTFT and TPOT) reaches this.",
    )
    scale_down_at: float = Field(
        0.6,
        ge=0,
        description="Shrink by one when one engine fewer would be expected at most this share"
        " (what a request alone gets stays, the part the load adds grows by n/(n-1)); below"
        " scale_up_at, so that a shrink does not grow straight back.",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="How long growth must be wanted.")
    downscale_delay_s: float = Field(60.0, ge=0, description="How long shrinking must be wanted.")
    window_s: float = Field(
        10.0, gt=0, description="The span each engine measures its TTFT and TPOT over."
    )
    drain_timeout_s: float = Field(
        120.0,
        ge=0,
        description="How long an engine taken out finishes the streams it carries before it"
        " stops (no new request reaches it meanwhile).",
    )

    @model_validator(mode="after")
    def _bounds_and_hysteresis(self) -> PoolAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})"
            )
        if self.scale_down_at >= self.scale_up_at:
            raise ValueError(
                f"scale_down_at ({self.scale_down_at:g}) must be below scale_up_at"
                f" ({self.scale_up_at:g}), or the pool would grow and shrink in turn"
            )
        return self


class PoolConfig(StrictModel):
    """A group of identical engine replicas with one role."""

    role: EngineRole = "mixed"
    replicas: int = Field(1, ge=1)
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    cpu_binds: list[str] | None = Field(
        None,
        description=(
            "CPU only: VLLM_CPU_OMP_THREADS_BIND per replica, e.g. ['0', '1'] or ['0|1'] for"
            " TP/PP=2. Unset: vLLM's automatic binding ('auto')."
        ),
    )
    kv_cache_gib: int = Field(1, ge=1, description="CPU only: KV cache GiB per engine.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="GPU only: the share of each GPU's memory the engine may take (weights,"
        " activations, KV cache); unset: vLLM's default, as vllm serve.",
    )
    kv_offloading_size: float | None = Field(
        None,
        gt=0,
        description="GPU only: GiB of host memory each engine's vLLM keeps KV blocks in"
        " once they leave its GPU cache (vllm serve's --kv-offloading-size, summed over the"
        " engine's TP ranks); unset: no offloading, as vllm serve. Not natively on CPU"
        " engines, which vLLM cannot offload, nor beside PD's and auto's KV hand-over yet.",
    )
    kv_offloading_backend: KVOffloadingBackend = Field(
        "native",
        description="Where kv_offloading_size's blocks go (vllm serve's"
        " --kv-offloading-backend): native, vLLM's own host tier; lmcache, an LMCache"
        " server the engine reaches (its own size then rules).",
    )
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra vLLM engine arguments (AsyncEngineArgs fields), checked by name;"
        " not those a field of ours sets.",
    )
    placement: PlacementConfig | None = Field(
        None,
        description="Run this pool's replicas on named Ray nodes (e.g. prefill on one"
        " node, decode on another). Placed pools run as engine replicas of their own.",
    )
    autoscaling: PoolAutoscaling | None = Field(
        None,
        description="Grow and shrink this pool with the load; ``replicas`` is then the number"
        " it starts with. Scaled pools run as engine replicas of their own.",
    )
    engines_per_process: int = Field(
        1,
        ge=1,
        description="How many of this pool's engines share one Serve replica's process"
        " (apart from the router's). Each engine keeps its name, transport and metrics;"
        " what they share is the process's memory and GIL: for simulated engines, whose"
        " steps are timers, so that one box holds a large fleet.",
    )

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return check_engine_kwargs(kwargs)

    @model_validator(mode="after")
    def _binds_match_replicas(self) -> PoolConfig:
        if self.cpu_binds is not None and len(self.cpu_binds) != self.most_replicas:
            counted = "replicas" if self.autoscaling is None else "autoscaling.max_replicas"
            raise ValueError(
                f"cpu_binds has {len(self.cpu_binds)} entries but {counted} is"
                f" {self.most_replicas};"
                " give one bind per replica"
            )
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        for bind in self.cpu_binds or []:
            if bind not in ("auto", "nobind") and len(bind.split("|")) != ranks:
                raise ValueError(
                    f"cpu_binds entry {bind!r} names {len(bind.split('|'))} rank(s) but the"
                    f" engine has tensor_parallel_size*pipeline_parallel_size = {ranks};"
                    " separate ranks with '|'"
                )
        return self

    @model_validator(mode="after")
    def _scaled_pool_bounds(self) -> PoolConfig:
        scaling = self.autoscaling
        if scaling is None:
            return self
        if self.engines_per_process > 1:
            raise ValueError(
                "engines_per_process > 1 groups a pool of fixed size; a scaled pool's"
                " engines are Serve replicas one by one"
            )
        if not scaling.min_replicas <= self.replicas <= scaling.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}), the count a scaled pool starts with, must be"
                f" within autoscaling's min_replicas ({scaling.min_replicas}) and"
                f" max_replicas ({scaling.max_replicas})"
            )
        return self

    @property
    def most_replicas(self) -> int:
        """The most engines the pool runs at once: its count, or a scaled pool's ceiling."""
        return self.replicas if self.autoscaling is None else self.autoscaling.max_replicas

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class EngineBackendConfig(StrictModel):
    """What runs behind each engine replica: vLLM, or a token generator for benchmarks."""

    backend: str = Field(
        "vllm",
        description="A registered engine backend (engines.backends.ENGINE_BACKENDS): vllm;"
        " simulated: vLLM's scheduling on a latency profile's time, no model (a GPU fleet"
        " on a CPU box); or synthetic: no model, every running request gets one token per"
        " step, to measure the router's relay capacity (bench/relay_capacity.py).",
    )
    profile: str | None = Field(
        None,
        description="simulated only: a latency profile file (python -m loadgen profile), a"
        " shipped profile's name, or a shipped family (h100-llama-3.1-8b) whose member for"
        " each pool's TP and PP degrees is taken.",
    )
    time_scale: float = Field(
        1.0,
        gt=0,
        description="simulated only: every simulated time is this many times longer, so that"
        " one box's router keeps up with many engines; reports divide it back out. The"
        " YAML's SLOs and prefill-policy times stay in the engines' own time: the router"
        " stretches them by this.",
    )
    spend: Literal["wall", "cpu"] = Field(
        "wall",
        description="simulated only: how a step's time passes. wall: the engine sleeps it, as"
        " a GPU's time takes none of the host's cores; cpu: a child process bound to the"
        " engine's cores (cpu_binds) computes for it, so that a simulated CPU engine"
        " shares its cores with the router and the client as a real one does (for checking"
        " a profile of this box's CPU engine: bench/sim_fidelity.py --spend cpu). Offline"
        " runs have no host and ignore it.",
    )
    step_interval_s: float = Field(
        0.0, ge=0, description="synthetic only: pause between steps; 0 runs them back to back."
    )
    step_log: str | None = Field(
        None,
        description="vllm only: a folder where each engine appends one JSON line per engine"
        " step (engines/step_log.py: its prefill tokens and sequences, decode sequences and"
        " context, and its duration), the step-level ruler's input (bench/step_ruler.py)."
        " Engines that overlap steps (async scheduling, PP) log none.",
    )
    max_num_seqs: int = Field(
        0,
        ge=0,
        description="synthetic only: the requests each step serves, oldest first, as vLLM's"
        " max_num_seqs caps a batch; later ones wait for their first token (0: no cap).",
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, name: str) -> str:
        from engines.backends import ENGINE_BACKENDS

        return ENGINE_BACKENDS.check(name)

    @model_validator(mode="after")
    def _fields_of_backend(self) -> EngineBackendConfig:
        simulated = self.backend == "simulated"
        if simulated and self.profile is None:
            raise ValueError(
                "engine.backend 'simulated' needs engine.profile: a profile file or a shipped"
                " profile's name (python -m loadgen profile --list)"
            )
        set_here = self.model_fields_set
        for name in ("profile", "time_scale", "spend"):
            if name in set_here and not simulated:
                raise ValueError(f"engine.{name} is for engine.backend 'simulated' only")
        if "step_log" in set_here and self.backend != "vllm":
            raise ValueError("engine.step_log is for engine.backend 'vllm' only")
        return self


class EngineSpec(StrictModel):
    """What one engine replica needs to start: its name, role, model and pool settings."""

    name: str
    role: EngineRole
    model: ModelConfig
    pool: PoolConfig
    accelerator: str
    # vLLM's kv_transfer_config for PD roles (the KV backend's connector), else None.
    kv_transfer: dict[str, Any] | None = None
    # The KV backend behind that connector: the host's side of the hand-over.
    kv_backend: KVTransferConfig | None = None
    # Publish the engine's KV events to its routers (router.prefix_signal: kv_events).
    kv_events: bool = False
    # Environment of this engine's own processes (its core binding, its KV cache size),
    # set while they are spawned: several engines may share one host process.
    process_env: dict[str, str] = Field(default_factory=dict)
    # GPU only, for engines that share a host process: the first of this engine's GPUs
    # among the host's (ray.get_gpu_ids()); None when the engine has the host's GPUs alone.
    device_offset: int | None = None
    backend: EngineBackendConfig = EngineBackendConfig()

    def as_member(self, name: str, local_rank: int) -> EngineSpec:
        """The engine of a scaled pool's replica: named after it, and on a CPU bound to
        the cores of its rank among the pool's replicas on its node (Serve hands ranks
        out from 0 and gives a stopped replica's rank to the next one it starts)."""
        env = {**self.process_env, ENGINE_NAME_ENV: name}
        binds = self.pool.cpu_binds
        if self.accelerator == "cpu" and binds:
            env[CPU_BIND_ENV] = binds[local_rank % len(binds)]
        return self.model_copy(update={"name": name, "process_env": env})
