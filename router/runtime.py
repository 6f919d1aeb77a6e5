"""What one served model routes with, built once from its binding: the engine pool (and
the watcher that follows a scaled pool's members), readiness, the stats poller, the
dispatcher, admission, the KV backend's router side, and the traffic record and drift.

``ServedModel`` (router/http/served_model.py) builds its ``Lifecycle`` from a
``ModelRuntime``; nothing here knows HTTP.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engines.backends import ENGINE_BACKENDS
from engines.contract import EngineLink
from engines.transport import SocketEngineLink
from kv_transfer import KVRouterSide, make_kv_backend
from router.dispatch import Dispatcher
from router.http.readiness import Readiness
from router.observation.metrics import ModelMetrics
from router.observation.traffic_drift import TrafficDrift
from router.observation.traffic_record import TrafficRecorder
from router.policies.prefill_gate import PrefillGate
from router.policies.qos import AdmissionControl
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineState
from router.pool.pooled_engine import LocalEngineLink, PooledEngine
from router.pool.stats_poller import EngineStatsPoller
from router.pool.watcher import PoolWatcher
from router.settings import IngressSettings, ModelBinding


@dataclass
class ModelRuntime:
    settings: IngressSettings
    pool: EnginePool
    # Engines this process hosts itself (restarted here if they die).
    local_engines: list[LocalEngineLink]
    watcher: PoolWatcher
    readiness: Readiness
    stats_poller: EngineStatsPoller
    dispatcher: Dispatcher
    admission: AdmissionControl
    kv: KVRouterSide | None
    recorder: TrafficRecorder | None
    drift: TrafficDrift | None

    def close(self) -> None:
        """Stopping, not dying: no engine is restarted and no stream reconnects."""
        self.watcher.stop()
        self.pool.close()
        if self.kv is not None:
            self.kv.shutdown()  # what the KV backend holds for this application goes with it


def build_runtime(
    binding: ModelBinding,
    metrics: ModelMetrics,
    on_engines_ready: Callable[[], Awaitable[None]],
) -> ModelRuntime:
    """``binding.engines``: Serve handles by engine name; ``binding.local_engines``: the
    specs of engines this process hosts itself; ``binding.pool_handles``: the Serve
    handles of scaled pools, by deployment name (see deployments/app.py).
    ``on_engines_ready``: run once every engine is up, before anything is admitted."""
    settings = binding.settings
    member = functools.partial(pooled_engine, settings)
    # Started side by side; each spawn alone (its processes inherit its environment).
    backend = ENGINE_BACKENDS.get(settings.engine_backend)
    restarts = settings.router.engine_restart_attempts
    local_engines = [
        LocalEngineLink(name, functools.partial(backend, spec), restarts)
        for name, spec in binding.local_engines.items()
    ]
    links: dict[str, EngineLink] = {
        name: SocketEngineLink(handle, engine=name) for name, handle in binding.engines.items()
    }
    links.update(zip(binding.local_engines, local_engines, strict=True))
    pool = EnginePool([member(name, binding.roles[name], link) for name, link in links.items()])
    pool.start()
    handles = binding.pool_handles
    watcher = PoolWatcher(
        pool, [(scaled, handles[scaled.deployment]) for scaled in settings.scaled_pools], member
    )
    watcher.start()
    # Engines load in the background; until all are up the router says so (503).
    readiness = Readiness(pool, on_engines_ready=on_engines_ready, members_known=watcher.populated)
    kv = None
    if settings.kv_transfer is not None:
        kv = make_kv_backend(settings.kv_transfer).router_side()
    router = settings.router
    stats_poller = EngineStatsPoller(
        pool,
        metrics,
        router.stats_interval_s,
        router.unhealthy_after_failed_polls,
        kv=kv,
        ema_weight=settings.qos.ema_weight,
        kv_interval_s=router.kv_metrics_interval_s,
    )
    dispatcher = Dispatcher(settings, pool, kv, stats_poller.transfer_cost.estimate_s)
    stats_poller.start()
    record, profile = router.traffic_record, router.traffic_profile
    return ModelRuntime(
        settings=settings,
        pool=pool,
        local_engines=local_engines,
        watcher=watcher,
        readiness=readiness,
        stats_poller=stats_poller,
        dispatcher=dispatcher,
        admission=AdmissionControl(settings.qos),
        kv=kv,
        recorder=TrafficRecorder(record, router.traffic_record_block_tokens) if record else None,
        drift=TrafficDrift(profile, metrics.traffic_drift, metrics.traffic_drifted)
        if profile
        else None,
    )


def pooled_engine(
    settings: IngressSettings, name: str, role: str, link: EngineLink
) -> PooledEngine:
    """One engine as the pool holds it, with the router's state of it."""
    return PooledEngine(
        name,
        role,
        link,
        settings.router.submit_timeout_s,
        EngineState(
            settings.qos.ema_weight,
            settings.qos.min_prefill_tokens_per_sample,
            kv_events_pending_s=settings.router.kv_events_pending_s,
        ),
        PrefillGate(settings.router.max_prefills_per_engine),
    )
