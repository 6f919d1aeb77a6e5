"""The router's settings, as the ``router:``, ``prefill_policy:``, ``qos:`` and ``auth:``
blocks of a Serve YAML's ``args`` give them, and what the builder hands the router per
model (``IngressSettings``, ``ModelBinding``). Every threshold the router acts on lives here or in
the settings model of the policy that uses it (``settings_model`` of a registered
engine choice or prefill policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, SecretStr, SerializeAsAny, field_validator, model_validator

from engines.protocol import EngineRole
from engines.settings import EngineSpec, ModelConfig, PlacementConfig
from kv_transfer.settings import KVTransferConfig
from splitserve.config_base import StrictModel, refuse_renamed
from splitserve.priorities import PRIORITIES as PRIORITIES  # re-exported for the router
from splitserve.priorities import Priority as Priority
from splitserve.registry import split_named_block, validate_settings

# The router's routes (router/http/ingress.py), by which keys are allowed and paths opened.
Route = Literal[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
]
# Routes that may answer without a key: never the ones that spend engine time.
OpenRoute = Literal["/v1/models", "/health", "/metrics"]
UnknownFields = Literal["ignore", "reject"]


def _engine_choices() -> Any:
    from router.policies.engine_choice import ENGINE_CHOICES

    return ENGINE_CHOICES


def _prefill_policies() -> Any:
    from router.policies.prefill_policy import PREFILL_POLICIES

    return PREFILL_POLICIES


class TrafficProfile(StrictModel):
    """What a shape was chosen for; live traffic is compared with it over a window."""

    prompt_tokens: float = Field(gt=0, description="Mean prompt length, in tokens.")
    output_tokens: float = Field(gt=0, description="Mean output length, in tokens.")
    request_rate: float | None = Field(
        None,
        gt=0,
        description="Requests per second the shape was measured to serve within its"
        " objectives (the advisor's knee); None: the rate is not compared.",
    )
    window_requests: int = Field(
        200, ge=2, description="Live traffic is the last this many answered requests."
    )
    tolerance: float = Field(
        1.5,
        gt=1,
        description="A ratio of live to profiled above this, or below its inverse, is drift.",
    )


class RouterConfig(StrictModel):
    replica_choice: str | dict[EngineRole, str] = Field(
        "round_robin",
        description="One registered engine choice for every pool, or one per role, e.g."
        " {prefill: least_loaded, decode: prefix_affinity} (router.replica_choice)",
    )
    replica_choice_settings: dict[str, SerializeAsAny[StrictModel]] = Field(
        default_factory=dict,
        description="Settings of an engine choice, by its name, e.g. {prefix_affinity:"
        " {max_load_imbalance: 4}}; unset fields take the policy's defaults.",
    )
    prefix_signal: Literal["kv_events", "mirror"] = Field(
        "kv_events",
        description="What the router knows of each engine's prefix cache: kv_events (the"
        " engine's own BlockStored/BlockRemoved events, evictions included) or mirror (what"
        " the router sent it, bounded by its capacity; blind to evictions). Engines that"
        " publish no events (the synthetic backend) are mirrored either way.",
    )
    kv_events_pending_s: float = Field(
        5.0,
        ge=0,
        description="With kv_events: a prompt sent to an engine counts as cached there for"
        " this long before the engine's events confirm its blocks (they are stored only"
        " once computed, and a request with the same prefix arriving meanwhile finds them"
        " by the time it runs); an eviction event ends it sooner. Cover a long prefill.",
    )
    placement: PlacementConfig | None = Field(
        None,
        description="Run the router (the HTTP ingress) on named Ray nodes, e.g. beside the"
        " decode pool, so that losing another node never takes the entry point with it.",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A request still generating after this long is aborted in its engine"
        " and answered with 504 (or an error event, if streaming).",
    )
    max_prefills_per_engine: int | None = Field(
        None,
        ge=1,
        description="Prompts inside one engine at once, from submission to first token; the"
        " rest wait in the router, high priority first (None: all go in at once, and the"
        " engine's own scheduler orders them).",
    )
    ready_wait_s: float = Field(
        5.0,
        ge=0,
        description="A request that arrives while the engines are still starting waits this"
        " long for them, then gets 503 with Retry-After (0: at once).",
    )
    health_check_timeout_s: float = Field(5.0, gt=0)
    unhealthy_after_failed_polls: int = Field(
        3, ge=1, description="Consecutive failed stats polls before an engine is skipped."
    )
    submit_timeout_s: float = Field(
        5.0, gt=0, description="An engine replica that takes longer to accept is unhealthy."
    )
    stats_interval_s: float = Field(
        0.2, gt=0, description="How often the router polls every engine for its load."
    )
    kv_metrics_interval_s: float = Field(
        1.0,
        gt=0,
        description="PD and auto: how often the router measures the hand-over rate the cost"
        " policy uses (from the transfer statistics the engines report with their load) and"
        " reads the KV backend's ledger (transfers by outcome, what it holds: a call to the"
        " KV directory actor; at the load interval that actor took 2% of a core).",
    )
    engine_restart_attempts: int = Field(
        3,
        ge=1,
        description="An engine in the router's process that dies is restarted there; after"
        " this many failed starts in a row the router fails its health check and Serve"
        " restarts it.",
    )
    traffic_record: str | None = Field(
        None,
        description="Append a content-free record of every answered request (arrival,"
        " lengths, priority, salted prefix block hashes; never text) to this file on the"
        " router's node, for python -m loadgen --trace recorded and the shape advisor.",
    )
    traffic_record_block_tokens: int = Field(
        16, ge=1, description="Prefix sharing is recorded in blocks of this many tokens."
    )
    traffic_profile: TrafficProfile | None = Field(
        None,
        description="The traffic this shape was chosen for (python -m loadgen advise writes"
        " it): the router exports how far live traffic has drifted from it"
        " (splitserve_traffic_drift_ratio) and logs when it leaves the tolerance.",
    )
    max_request_bytes: int = Field(
        8 * 2**20,
        ge=1,
        description="A request body larger than this is refused with 413 before it is read"
        " whole (a prompt of the longest context, as text or as token ids, is far smaller).",
    )
    inline_prepare_max_bytes: int = Field(
        2 * 2**10,
        ge=0,
        description="A request body up to this size is parsed, templated and tokenized on"
        " the event loop (about 1 ms for 2 KiB on the tiny model's tokenizer, about 0.5 us"
        " per character, where the hop to a thread costs 0.13 ms); a larger one, or one with"
        " its own chat template, in a worker thread, so that other requests' streams do"
        " not wait for it (0: every request in a thread).",
    )
    prepare_threads: int = Field(
        2,
        ge=1,
        description="Worker threads for large requests' parsing and tokenization; more"
        " wait their turn, so a burst of large bodies cannot take every core.",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="Render a chat template sent in a request (chat_template, or"
        " chat_template_kwargs.chat_template); false: such a request is refused (400), as"
        " vLLM's --trust-request-chat-template does. A template is code that the router"
        " runs: a hostile one can hold a core for as long as it likes.",
    )
    unknown_fields: UnknownFields = Field(
        "ignore",
        description="Request fields that neither OpenAI's API nor vLLM's knows: ignore (as"
        " vLLM does; their names are logged at debug level) or reject (400 naming the"
        " first, as OpenAI's API does).",
    )
    engine_in_router: Literal["auto"] | bool = Field(
        "auto",
        description="Host every engine in the router's own process, each engine core in"
        " processes of its own (vLLM's data-parallel layout): true, false (one Serve"
        " replica per engine, in a process of its own, reached over a direct TCP connection),"
        " or auto (true for CPU engines; false for GPU engines, and for pools placed on"
        " named nodes or scaled by Serve).",
    )

    @field_validator("replica_choice")
    @classmethod
    def _registered_choices(cls, value: str | dict[EngineRole, str]) -> str | dict[EngineRole, str]:
        names = [value] if isinstance(value, str) else list(value.values())
        for name in names:
            _engine_choices().check(name)
        return value

    @field_validator("replica_choice_settings", mode="before")
    @classmethod
    def _choice_settings(cls, value: Any) -> dict[str, StrictModel]:
        if not isinstance(value, dict):
            raise ValueError("must map an engine choice's name to its settings")
        return {
            name: validate_settings(_engine_choices(), name, raw, f"replica_choice_settings.{name}")
            for name, raw in value.items()
        }

    def choice_for(self, role: str) -> str:
        choice = self.replica_choice
        if isinstance(choice, str):
            return choice
        return next((name for pool, name in choice.items() if pool == role), "round_robin")

    def choice_settings(self, name: str) -> StrictModel:
        """The settings of engine choice ``name``: as configured, or its defaults."""
        configured = self.replica_choice_settings.get(name)
        return configured or validate_settings(_engine_choices(), name, {}, name)


class PrefillPolicyConfig(StrictModel):
    """PD and auto only: which registered prefill policy decides where a prompt is
    computed, and its settings; in YAML one flat block, ``name`` plus the policy's own
    fields."""

    RENAMED: ClassVar[dict[str, str]] = {"mode": "name"}
    name: str = Field(
        "conditional",
        description="A registered prefill policy (router.prefill_policy): always (the study's PD),"
        " never (the decode engine prefills every prompt), conditional, cost (weighs the"
        " KV hand-over and both engines' load; auto's default).",
    )
    settings: SerializeAsAny[StrictModel] = Field(default_factory=StrictModel)

    @model_validator(mode="before")
    @classmethod
    def _settings_of_policy(cls, data: Any) -> Any:
        refuse_renamed(cls.RENAMED, data)
        return split_named_block(data, "name", "conditional", _prefill_policies(), "prefill_policy")

    def flat(self) -> dict[str, Any]:
        """As the YAML writes it: ``name`` and the policy's fields in one block."""
        return {"name": self.name, **self.settings.model_dump()}


def _refuse_low_first() -> dict[Priority, float]:
    return {"low": 1.0}


def _default_queue_caps() -> dict[Priority, int]:
    return {"high": 256, "normal": 128, "low": 64}


class QoSConfig(StrictModel):
    """Admission control: who is refused, when, and how they are told."""

    enabled: bool = False
    default_priority: Priority = "normal"
    ttft_slo_s: float = Field(
        2.0, gt=0, description="Time to first token promised to admitted requests."
    )
    early_rejection_s: dict[Priority, float] = Field(
        default_factory=_refuse_low_first,
        description="Per priority, the estimated TTFT above which it is refused (503); at most"
        " ttft_slo_s. Below the SLO it leaves headroom for the priorities never refused (the"
        " chapter's low_priority_threshold_ms).",
    )
    queue_caps: dict[Priority, int] = Field(
        default_factory=_default_queue_caps,
        description="Requests waiting for their first token, router-wide, at which a request of"
        " this priority is refused (429).",
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After on a refusal, in seconds.")
    low_priority_remote_max_queue: int = Field(
        1,
        ge=0,
        description="PD: low priority is prefilled remotely only while the prefill queue is"
        " shorter than this.",
    )
    ema_weight: float = Field(
        0.2, gt=0, le=1, description="Weight of the newest sample in the per-token time averages."
    )
    min_prefill_tokens_per_sample: int = Field(
        64,
        ge=1,
        description="A first token after fewer prefill tokens than this says more about fixed"
        " overhead than per-token cost, so it does not update the average.",
    )
    calibration_prompt_tokens: int = Field(
        512,
        ge=0,
        description="Once its engines are up, the router times one prefill of this many"
        " tokens on each before admitting anything, so the TTFT estimate holds from the"
        " first request (0: none; the estimate then admits all until a first token).",
    )

    @model_validator(mode="after")
    def _every_priority_capped(self) -> QoSConfig:
        missing = [p for p in PRIORITIES if p not in self.queue_caps]
        if missing:
            raise ValueError(f"queue_caps needs a cap for every priority; missing {missing}")
        loose = {p: s for p, s in self.early_rejection_s.items() if not 0 < s <= self.ttft_slo_s}
        if loose:
            raise ValueError(
                f"early_rejection_s must be above 0 and at most ttft_slo_s"
                f" ({self.ttft_slo_s:g} s); got {loose}"
            )
        return self


class ApiKeyConfig(StrictModel):
    """One API key and what its holder may do. The key is given by the name of an
    environment variable of the router's process (``key_env``), which keeps it out of
    YAML files, or as it is (``key``)."""

    name: str | None = Field(
        None,
        min_length=1,
        description="The key's name in metrics and logs, never the key itself (default:"
        " key_env, or keys[<index>]).",
    )
    key: SecretStr | None = Field(None, description="The key itself.")
    key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The environment variable, in the router's process, that holds the key.",
    )
    max_priority: Priority = Field(
        "high",
        description="The highest priority this key's requests get; one that asks for more is"
        " served at this one (and counted), not refused.",
    )
    max_queued: int | None = Field(
        None,
        ge=1,
        description="This key's requests waiting for their first token at which another of"
        " its requests is refused (429); None: only qos.queue_caps apply.",
    )
    routes: list[Route] | None = Field(
        None, description="The routes this key may call (403 on others); None: all."
    )
    weight: float = Field(
        1.0,
        ge=0.001,
        le=1000,
        description="This key's fair share against the other keys with requests waiting at"
        " the same priority: served in turns in proportion to weights, and refused only"
        " once over its share of a full queue (requests without a key: one flow of weight"
        " 1).",
    )

    @field_validator("key")
    @classmethod
    def _sendable(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            check_key_text(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeyConfig:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("give the key either by key_env (preferred) or by key, not both")
        return self


def check_key_text(key: str) -> None:
    """A key must fit ``Authorization: Bearer <key>``: visible ASCII, no spaces. The
    message never quotes the key."""
    if not key:
        raise ValueError("the key is empty")
    if not all("!" <= char <= "~" for char in key):
        raise ValueError(
            "a key must be visible ASCII characters without spaces, as an HTTP"
            " Authorization header carries it"
        )


class AuthConfig(StrictModel):
    """Who may call the router (the ``auth:`` block). With no key here and none in the
    environment (SPLITSERVE_API_KEYS, VLLM_API_KEY), every route is open: allowed on a
    loopback address, and beyond it only with ``allow_open``."""

    keys: list[ApiKeyConfig] = Field(default_factory=list)
    open_paths: list[OpenRoute] = Field(
        default_factory=lambda: list[OpenRoute](["/health", "/metrics"]),
        description="Routes that answer without a key when keys are configured: /health"
        " for load balancers' and Kubernetes' probes, /metrics for Prometheus, as vLLM's"
        " server leaves it open. Leave /metrics out to guard it too (it names the keys and"
        " shows the traffic) and give Prometheus a key of its own with routes: [/metrics].",
    )
    allow_open: bool = Field(
        False,
        description="Serve every route without a key on an address beyond loopback"
        " (http_options.host: 0.0.0.0 and no keys). Without it such a router stops at start.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Retry-After on a refusal for a key's max_queued, in seconds."
    )

    @model_validator(mode="after")
    def _names_unique(self) -> AuthConfig:
        names = self.key_names()
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"keys: each key needs a name of its own; repeated: {repeated}")
        return self

    def key_names(self) -> list[str]:
        return [key.name or key.key_env or f"keys[{index}]" for index, key in enumerate(self.keys)]


class ScaledPoolSettings(StrictModel):
    """A pool that Serve grows and shrinks: one Serve deployment whose replicas the
    router follows (router/pool/watcher.py)."""

    deployment: str  # the pool's Serve deployment (decode-pool)
    name: str  # its members' engine names start so (decode-<replica id>)
    role: str
    drain_timeout_s: float


class IngressSettings(StrictModel):
    """What the application builder hands one router process: the settings objects of
    the YAML that concern it, validated once by the builder, never dumped and re-read."""

    shape: str
    model: ModelConfig
    router: RouterConfig
    prefill_policy: PrefillPolicyConfig
    qos: QoSConfig
    kv_transfer: KVTransferConfig | None = None  # PD and auto only
    engine_backend: str = "vllm"
    auth: AuthConfig = Field(default_factory=AuthConfig)
    # Where Serve listens for HTTP (the YAML's http_options.host), when the builder
    # knows it: without keys, a router reachable beyond this machine says so at start.
    http_host: str | None = None
    scaled_pools: list[ScaledPoolSettings] = Field(default_factory=list)
    # The engine_kwargs of the pool that generates (decode, or the mixed one): vLLM's
    # serving layer in the router reads the same limits (router/http/vllm_frontend.py).
    generating_engine_kwargs: dict[str, Any] = Field(default_factory=dict)

    @property
    def disaggregated(self) -> bool:
        """Separate prefill and decode pools (PD); auto's one pool is auto."""
        return self.kv_transfer is not None and self.shape == "pd"


@dataclass
class ModelBinding:
    """One served model as the application builder binds it to the router: its settings
    and its engines (deployments/app.py). Serve replaces the bound engine deployments
    inside it by their handles when the router starts."""

    settings: IngressSettings
    roles: dict[str, str]  # each engine's role, by engine name
    engines: dict[str, Any] = field(default_factory=dict)  # Serve handles, by engine name
    local_engines: dict[str, EngineSpec] = field(default_factory=dict)  # hosted in the router
    pool_handles: dict[str, Any] = field(default_factory=dict)  # scaled pools, by deployment
