"""One vLLM engine (AsyncLLM): hosted in the router's process, or in a Ray Serve replica
of its own (``EngineReplica``) that routers reach over engines/transport.py.

It takes token ids and a SamplingParams, and streams token deltas back: every
request's deltas of one engine step travel together on one long-lived stream per
router process (``deltas``), so a message carries one engine step of many requests
rather than one token of one request. Everything OpenAI-shaped lives in the router;
see docs/DECISIONS.md for why we host AsyncLLM ourselves instead of through
ray.serve.llm's LLMServer.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import psutil
import ray
from ray import serve

from engines.backends import ENGINE_BACKENDS
from engines.contract import EngineBackend
from engines.delta_streams import DeltaStreams, Outbox
from engines.kv_events import KVEventRelay
from engines.metrics import replica_stat_logger
from engines.model_source import resolve_adapter_path, resolve_model
from engines.protocol import (
    CACHE_UPDATES,
    CacheUpdate,
    DeltaBatch,
    EngineStats,
    GenerateChunk,
    GenerateFailure,
    GenerateRequest,
    LoraAdapter,
    TokenLogprobs,
)
from engines.sampler import start_replica_sampler
from engines.settings import EngineSpec, member_name
from engines.slo_meter import MeteredHost, SloMeter
from engines.socket_folders import VLLM_IPC_ENV, owned_folder, remove_folder
from engines.step_log import STEP_LOG_ENV, step_log_path
from engines.transport import EngineTransportServer, TransportAddress
from kv_transfer.backend_registry import make_kv_backend
from kv_transfer.metrics import TransferTotals

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("splitserve.engine")
# vLLM's names for where a prompt token's KV came from (PromptTokenStats.ALL_SOURCES).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Our logits processor (FQCN), loaded by vLLM inside the engine core only.
CONTINUATION = "engines.continuation:ContinuationProcessor"
_SPAWN_LOCK = threading.Lock()
SPAWN_POLL_S = 0.02  # how often a spawning engine looks for its new process
# How long an engine taken out of a scaled pool serves before it looks whether it is
# idle (a router learns of its removal a moment after Serve decides it), and how often
# it looks after that.
DRAIN_SETTLE_S = 1.0
DRAIN_POLL_S = 0.1


class _LatestSchedulerStats:
    """Holds what the engine's scheduler last reported, for the router to read."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.reported_at = 0.0
        self.prompt_tokens = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        # The KV connector's transfer statistics since the engine started (None until
        # the first), added up from what vLLM hands the stat loggers each interval.
        self.kv_transfer: TransferTotals | None = None

    def add_kv_transfer(self, data: dict[str, Any]) -> None:
        if self.kv_transfer is None:
            self.kv_transfer = TransferTotals()
        self.kv_transfer.add(data)

    def add_iteration(self, iteration_stats: Any) -> None:
        sources = iteration_stats.prompt_token_stats
        for source in PROMPT_TOKEN_SOURCES:
            self.prompt_tokens[source] += sources.get_by_source(source)

    def update(self, scheduler_stats: Any) -> None:
        self.num_running = scheduler_stats.num_running_reqs
        self.num_waiting = scheduler_stats.num_waiting_reqs
        self.kv_cache_usage = scheduler_stats.kv_cache_usage
        prefix = scheduler_stats.prefix_cache_stats
        self.prefix_cache_queries += prefix.queries
        self.prefix_cache_hits += prefix.hits
        self.reported_at = time.time()


def _stat_logger_factory(latest: _LatestSchedulerStats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    from kv_transfer.object_store.stats import TransferStats

    class SchedulerStatsTap(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._connector_stats = _connector_stats_builder(vllm_config)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                latest.update(scheduler_stats)
                payload = scheduler_stats.kv_connector_stats
                if payload and self._connector_stats is not None:
                    transfer = self._connector_stats(payload)
                    if isinstance(transfer, TransferStats):
                        latest.add_kv_transfer(transfer.data)
            if iteration_stats is not None:
                latest.add_iteration(iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return SchedulerStatsTap


def _connector_stats_builder(vllm_config: Any) -> Any:
    """The configured KV connector's ``build_kv_connector_stats``, as vLLM's own stat
    loggers resolve it; None without a connector."""
    transfer_config = vllm_config.kv_transfer_config
    if transfer_config is None or not transfer_config.kv_connector:
        return None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class(transfer_config).build_kv_connector_stats


def build_engine_args(spec: EngineSpec, kv_events: KVEventRelay | None = None) -> Any:
    """vLLM's engine arguments; ``kv_events``: the relay the engine publishes them to."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    model = resolve_model(spec.model)
    pool = spec.pool
    kwargs: dict[str, Any] = {
        "model": model.path,
        "served_model_name": [model.served_name],
        "dtype": spec.model.engine_dtype,
        "max_model_len": spec.model.max_model_len,
        "enforce_eager": spec.model.eager_on(spec.accelerator),
        "seed": spec.model.seed,
        "enable_prefix_caching": spec.model.enable_prefix_caching,
        "tensor_parallel_size": pool.tensor_parallel_size,
        "pipeline_parallel_size": pool.pipeline_parallel_size,
        "disable_log_stats": False,
    }
    if pool.ranks_per_replica > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if spec.model.block_size is not None:
        kwargs["block_size"] = spec.model.block_size
    if spec.model.lora_enabled:
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = spec.model.loras_per_batch(spec.accelerator)
        kwargs["max_lora_rank"] = spec.model.max_lora_rank
    if spec.model.reasoning_parser is not None:
        # Structured outputs apply after the reasoning ends, as in `vllm serve`.
        kwargs["reasoning_parser"] = spec.model.reasoning_parser
    if spec.accelerator == "gpu" and pool.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = pool.gpu_memory_utilization
    if pool.kv_offloading_size is not None:
        kwargs["kv_offloading_size"] = pool.kv_offloading_size
        kwargs["kv_offloading_backend"] = pool.kv_offloading_backend
    if spec.kv_transfer is not None:
        kwargs["kv_transfer_config"] = spec.kv_transfer
    if kv_events is not None:
        kwargs["kv_events_config"] = kv_events.events_config()
    kwargs.update(pool.engine_kwargs)
    if spec.kv_transfer is not None:
        # A request handed over to this engine continues from the prefill engine's tokens.
        kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or ()), CONTINUATION]
    return AsyncEngineArgs(**kwargs)


def _lora_request(adapter: LoraAdapter) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.int_id, resolve_adapter_path(adapter.path))


def _chunks_of(output: Any) -> list[GenerateChunk]:
    """One chunk per completion that moved in this RequestOutput (``n`` > 1 has several)."""
    prompt_logprobs = _prompt_logprobs_of(output.prompt_logprobs)
    chunks = []
    for completion in output.outputs:
        chunks.append(
            GenerateChunk(
                token_ids=list(completion.token_ids),
                text=completion.text,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                num_prompt_tokens=len(output.prompt_token_ids or ()),
                num_cached_tokens=output.num_cached_tokens or 0,
                kv_transfer_params=output.kv_transfer_params if output.finished else None,
                index=completion.index,
                logprobs=_logprobs_of(completion.logprobs),
                prompt_logprobs=prompt_logprobs,
            )
        )
        prompt_logprobs = None  # once per request
    return chunks


def _position_logprobs(position: Any) -> TokenLogprobs:
    return [(token, lp.logprob, lp.rank, lp.decoded_token) for token, lp in position.items()]


def _logprobs_of(positions: Any) -> list[TokenLogprobs] | None:
    """vLLM's sampled logprobs (a dict per generated token) as plain data, in order."""
    return None if positions is None else [_position_logprobs(p) for p in positions]


def _prompt_logprobs_of(positions: Any) -> list[TokenLogprobs | None] | None:
    """vLLM's prompt logprobs as plain data: None for the first token, which has none."""
    if positions is None:
        return None
    return [None if p is None else _position_logprobs(p) for p in positions]


@ENGINE_BACKENDS.register("vllm")
class EngineHost:
    """One AsyncLLM and its engine processes, in whichever process constructs it: the
    router's (every engine's front end there, by default) or an engine replica's (below).
    """

    def __init__(self, spec: EngineSpec) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._spec = spec
        # vLLM's engine processes are not Ray workers; the KV connector inside them
        # joins this cluster itself, by the address it inherits from here. Always this
        # cluster's own address: a worker inherits RAY_ADDRESS from whoever started the
        # cluster, and "local" (`RAY_ADDRESS=local serve run ...`) would make every engine
        # start a Ray instance of its own, where no transfer is ever found.
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        self._latest = _LatestSchedulerStats()
        self._streams = DeltaStreams()
        self._running: dict[str, tuple[str, asyncio.Task[None]]] = {}
        # The loop the delta streams are read on, once a router subscribes: the KV event
        # relay's thread hands its cache updates over to it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kv_events = (
            KVEventRelay(spec.name, self._relay_cache_update) if spec.kv_events else None
        )
        if self._kv_events is not None:
            self._kv_events.start()
        # vLLM's IPC sockets, in a folder that goes with this engine (socket_folders).
        self._ipc_folder = owned_folder("vllm")
        started = time.perf_counter()
        gpu_ids = self._gpu_ids()
        # One spawn at a time per process: each engine's processes must inherit its own
        # environment, not a neighbour's. Only the spawn itself: the engines of one
        # router then load side by side, each on its own cores.
        try:
            with _spawning_with(self._process_env(gpu_ids)):
                self._engine: AsyncLLM = AsyncLLM.from_engine_args(
                    build_engine_args(self._spec, self._kv_events),
                    stat_loggers=[
                        _stat_logger_factory(self._latest),
                        replica_stat_logger(self._spec.name, self._spec.role),
                    ],
                )
        except BaseException:
            if self._kv_events is not None:
                self._kv_events.stop()  # no engine will publish to it
            remove_folder(self._ipc_folder)
            raise
        # After the engine: its processes exist now, and a failed start samples nothing.
        # An engine that shares its host process samples its own engine core alone.
        root_pid = os.getpid() if self._spec.device_offset is None else self._engine_core_pid()
        self._sampler = start_replica_sampler(self._spec.name, self._spec.role, gpu_ids, root_pid)
        # vLLM refuses a priority other than 0 unless it schedules by priority.
        self._schedules_by_priority = self._engine.vllm_config.scheduler_config.policy == "priority"
        # The KV backend's part in this host: how prefill requests name the engine (reported
        # with every stats), and which handles it refuses.
        self._kv = make_kv_backend(spec.kv_backend).engine_side() if spec.kv_backend else None
        self._kv_consumer = self._kv.consumer_name(self._engine.vllm_config) if self._kv else None
        logger.info(
            "engine %s (%s) ready in %.1fs",
            self._spec.name,
            self._spec.role,
            time.perf_counter() - started,
        )

    def _gpu_ids(self) -> list[int]:
        if self._spec.accelerator != "gpu":
            return []
        host_ids = [int(i) for i in ray.get_gpu_ids()]
        offset = self._spec.device_offset
        if offset is None:
            return host_ids
        return host_ids[offset : offset + self._spec.pool.ranks_per_replica]

    def _process_env(self, gpu_ids: list[int]) -> dict[str, str]:
        env = {**self._spec.process_env, VLLM_IPC_ENV: str(self._ipc_folder)}
        if self._spec.backend.step_log:
            env[STEP_LOG_ENV] = step_log_path(self._spec.backend.step_log, self._spec.name)
        if self._spec.device_offset is not None and gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
        return env

    def _engine_core_pid(self) -> int:
        manager = getattr(self._engine.engine_core.resources, "engine_manager", None)
        processes = getattr(manager, "processes", None) or []
        return processes[0].pid if processes else os.getpid()

    async def submit(self, request: GenerateRequest) -> None:
        """Start a request; its deltas go out on the subscriber's ``deltas`` stream."""
        if request.request_id in self._running:
            raise ValueError(f"request id {request.request_id!r} is already running")
        if self._kv is not None and request.kv_transfer_params is not None:
            # Refuse KV from an engine with another layout now, with the fields that
            # differ, instead of letting the connector fall back silently.
            self._kv.check_request(request.kv_transfer_params, self._engine.vllm_config)
        outbox = self._streams.outbox(request.subscriber)
        task = asyncio.get_running_loop().create_task(self._run(request, outbox))
        self._running[request.request_id] = (request.subscriber, task)
        task.add_done_callback(lambda _: self._running.pop(request.request_id, None))

    async def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); cancelling aborts it inside vLLM."""
        entry = self._running.get(request_id)
        if entry is not None:
            entry[1].cancel()

    def deltas(self, subscriber: str) -> AsyncIterator[DeltaBatch]:
        """One long-lived stream per router process, carrying every request it submitted.

        Each item holds all deltas ready since the previous one, so a Ray message
        carries one engine step of many requests instead of one token of one request.
        """
        self._loop = asyncio.get_running_loop()
        if self._kv_events is not None:
            # A router's view of the cache starts whole; later changes follow it.
            outbox = self._streams.outbox(subscriber)
            outbox.put_nowait((CACHE_UPDATES, self._kv_events.snapshot()))
        return self._streams.stream(subscriber, self._subscriber_gone)

    def _relay_cache_update(self, update: CacheUpdate) -> None:
        """From the relay's thread: to every router's stream, on their loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._streams.broadcast, (CACHE_UPDATES, update))

    def _subscriber_gone(self, subscriber: str) -> None:
        # The router process is gone (or resubscribes): nobody will read these.
        for request_id, (owner, task) in list(self._running.items()):
            if owner == subscriber:
                task.cancel()
                logger.info("aborted %s: its router stopped listening", request_id)

    def close_streams(self) -> None:
        """End every ``deltas`` stream (after what is queued), so subscribers move on."""
        self._streams.close_all()

    @property
    def dead(self) -> bool:
        """The engine failed for good (a process of it died); only a new host serves."""
        return self._engine.errored

    async def _run(self, request: GenerateRequest, outbox: Outbox) -> None:
        from vllm.inputs import TokensPrompt

        params = request.sampling_params
        if request.kv_transfer_params is not None:
            params.extra_args = {
                **(params.extra_args or {}),
                "kv_transfer_params": request.kv_transfer_params,
            }
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
        priority = request.scheduling_priority() if self._schedules_by_priority else 0
        lora = None if request.lora is None else _lora_request(request.lora)
        try:
            async for output in self._engine.generate(
                prompt, params, request.request_id, priority=priority, lora_request=lora
            ):
                for chunk in _chunks_of(output):
                    outbox.put_nowait((request.request_id, chunk))
        except asyncio.CancelledError:
            # AsyncLLM.generate aborts what it has registered, but a cancel that lands
            # while the request is being added leaves it running with nobody reading.
            await self._engine.abort(request.request_id)
            raise
        except Exception as error:
            logger.exception("request %s failed", request.request_id)
            failure = GenerateFailure(f"{type(error).__name__}: {error}", engine_dead=self.dead)
            outbox.put_nowait((request.request_id, failure))

    def stats(self) -> EngineStats:
        latest = self._latest
        cache = self._engine.vllm_config.cache_config
        return EngineStats(
            replica=self._spec.name,
            role=self._spec.role,
            num_running=latest.num_running,
            num_waiting=latest.num_waiting,
            num_unfinished=self._engine.output_processor.get_num_unfinished_requests(),
            kv_cache_usage=latest.kv_cache_usage,
            prefix_cache_queries=latest.prefix_cache_queries,
            prefix_cache_hits=latest.prefix_cache_hits,
            reported_at=latest.reported_at,
            block_size=cache.block_size or 0,
            kv_capacity_blocks=cache.num_gpu_blocks or 0,
            prompt_tokens=dict(latest.prompt_tokens),
            kv_consumer=self._kv_consumer,
            max_model_len=self._engine.vllm_config.model_config.max_model_len,
            kv_transfer=None
            if latest.kv_transfer is None
            else copy.deepcopy(latest.kv_transfer.data),
        )

    async def check_health(self) -> None:
        # Serve calls this periodically; raising marks the replica unhealthy and restarts it.
        await self._engine.check_health()

    async def add_lora(self, adapter: LoraAdapter) -> None:
        """Load an adapter now (vLLM would on its first request), so that a bad path
        fails here, at load time, rather than in a client's request."""
        await self._engine.add_lora(_lora_request(adapter))

    async def remove_lora(self, adapter: LoraAdapter) -> None:
        await self._engine.remove_lora(adapter.int_id)

    def shutdown(self) -> None:
        sampler = getattr(self, "_sampler", None)
        if sampler is not None:
            sampler.stop()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
        kv_events = getattr(self, "_kv_events", None)
        if kv_events is not None:
            kv_events.stop()
        ipc_folder = getattr(self, "_ipc_folder", None)
        if ipc_folder is not None:
            remove_folder(ipc_folder)


@contextlib.contextmanager
def _spawning_with(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in os.environ, and no other engine spawning, until this block's engine
    core process exists (a forked child keeps the environment it was forked with) or
    the block ends; then the environment is restored and the next engine may spawn.

    vLLM's engine processes read their core binding and KV size from the environment
    they inherit; the front end reads vllm.envs lazily, so nothing keeps the values.
    """
    _SPAWN_LOCK.acquire()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    me = psutil.Process()
    before = {child.pid for child in me.children()}
    done = threading.Event()

    def release_once_spawned() -> None:
        try:
            while not done.wait(SPAWN_POLL_S) and not _spawned_since(me, before):
                pass
        finally:
            _restore(saved)
            _SPAWN_LOCK.release()

    watcher = threading.Thread(target=release_once_spawned, name="splitserve-spawn", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _spawned_since(me: psutil.Process, before: set[int]) -> bool:
    """Whether a process multiprocessing spawned is among ``me``'s new children: the
    engine core (multiprocessing's resource tracker, spawned just before it, is not)."""
    for child in me.children():
        if child.pid not in before:
            with contextlib.suppress(psutil.Error):
                command = " ".join(child.cmdline())
                if "spawn_main" in command or "VLLM::" in command:
                    return True
    return False


def _restore(saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class EngineReplica:
    """A Serve replica that hosts one engine (any backend) in a process of its own, so
    its front end (output processing, detokenization, stat loggers) runs beside the
    other engines' and the router's, not on their GIL. Routers reach it through its
    transport (engines/transport.py); Serve places, health-checks and restarts it.

    A scaled pool (``pools[].autoscaling``) is one Serve deployment of many such
    replicas: each names its engine after its Serve replica id, reports the SLO
    measurements Serve's autoscaling policy reads, and when Serve takes it out, it
    finishes the streams it carries before its engine stops."""

    async def __init__(self, spec: EngineSpec) -> None:  # type: ignore[misc]  # Serve awaits it
        context = serve.get_replica_context()
        self._scaling = spec.pool.autoscaling
        if self._scaling is None and context.world_size != 1:
            # A plain `serve run` applies a YAML's deployment overrides without our
            # launcher, which refuses them: a second replica under one engine name would
            # split one engine name over two engines the router cannot tell apart.
            raise ValueError(
                f"engine deployment {spec.name!r} has {context.world_size} Serve replicas;"
                " scale engines by args.pools[].replicas or pools[].autoscaling,"
                " not by Serve overrides"
            )
        if self._scaling is not None:
            name = member_name(spec.name, context.replica_id.unique_id)
            spec = spec.as_member(name, context.rank.local_rank)
        # Routers send vLLM's SamplingParams: without this, unpickling the first submit
        # would import vLLM (seconds) on the event loop of a synthetic engine.
        import vllm.sampling_params  # noqa: F401

        self._host = ENGINE_BACKENDS.get(spec.backend.backend)(spec)
        # Only a scaled pool's engines measure what their requests get: it costs a look
        # at every engine step, and nothing else reads it.
        self._metered: MeteredHost | None = None
        if self._scaling is not None:
            meter = SloMeter(self._scaling.window_s, time_scale=spec.backend.time_scale)
            self._metered = MeteredHost(self._host, meter)
        self._transport = EngineTransportServer(self._metered or self._host)
        await self._transport.start(ray.util.get_node_ip_address())

    def transport_address(
        self, replica: str | None = None, engine: str | None = None
    ) -> TransportAddress:
        """Where routers connect, and the secret they say first (asked once per connect).

        ``replica``: the Serve replica id a router means, for a scaled pool; the pool's
        request router (router/pool/membership.py) sends the call there. ``engine``: the
        engine a router means, which is this replica's one engine."""
        assert self._transport.address is not None
        return self._transport.address

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaling reads these (engines/pool_scaling.py); Serve asks only the
        replicas of a deployment it autoscales, which are the metered ones."""
        return self._metered.meter.signals() if self._metered is not None else {}

    async def check_health(self) -> None:
        # Serve calls this periodically; raising marks the replica unhealthy and restarts it.
        await self._host.check_health()

    async def __del__(self) -> None:
        metered = getattr(self, "_metered", None)  # only a scaled pool's engines drain
        if metered is not None and self._scaling is not None:
            await drain(metered.meter, self._scaling.drain_timeout_s)
        transport = getattr(self, "_transport", None)
        if transport is not None:
            await transport.stop()
        host = getattr(self, "_host", None)
        if host is not None:
            host.shutdown()


class EngineGroupReplica:
    """A Serve replica that hosts several engines of one pool in its process (the pool's
    ``engines_per_process``), each under its own name, with a transport of its own:
    routers reach each engine as if it had a replica to itself. Serve places,
    health-checks and restarts the group as one."""

    async def __init__(self, specs: list[EngineSpec]) -> None:  # type: ignore[misc]  # Serve awaits it
        import vllm.sampling_params  # noqa: F401  (as EngineReplica: before any submit)

        self._hosts: dict[str, EngineBackend] = {}
        self._transports: dict[str, EngineTransportServer] = {}
        node_ip = ray.util.get_node_ip_address()
        try:
            for spec in specs:
                host = ENGINE_BACKENDS.get(spec.backend.backend)(spec)
                self._hosts[spec.name] = host
                transport = EngineTransportServer(host)
                self._transports[spec.name] = transport
                await transport.start(node_ip)
        except BaseException:
            await self.__del__()  # the engines that did start stop with the group
            raise

    def transport_address(
        self, replica: str | None = None, engine: str | None = None
    ) -> TransportAddress:
        """Where routers connect to ``engine``, and the secret they say first."""
        transport = self._transports.get(engine or "")
        if transport is None:
            raise ValueError(f"no engine {engine!r} here; this process hosts {list(self._hosts)}")
        assert transport.address is not None
        return transport.address

    async def check_health(self) -> None:
        for host in self._hosts.values():
            await host.check_health()

    async def __del__(self) -> None:
        for transport in getattr(self, "_transports", {}).values():
            await transport.stop()
        for host in getattr(self, "_hosts", {}).values():
            host.shutdown()


async def drain(meter: SloMeter, timeout_s: float) -> None:
    """Wait for the requests this engine carries to finish, up to ``timeout_s``.

    Serve stops sending a replica it takes out at once, but a router learns of it a
    moment later: requests that arrive meanwhile are served too (DRAIN_SETTLE_S)."""
    deadline = time.monotonic() + timeout_s
    await asyncio.sleep(min(DRAIN_SETTLE_S, timeout_s))
    while meter.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if meter.in_flight > 0:
        logger.warning("stopping with %d requests still in flight", meter.in_flight)
