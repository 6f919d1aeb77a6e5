"""Where one request runs: which replica of which pool, and for PD where it prefills."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.config import AppConfig
from deployments.protocol import GenerateChunk, GenerateRequest
from router.engine_client import EngineClient
from router.pd import PrefillDecodeFlow, PrefillOutcome
from router.replicas import ReplicaChoice, make_replica_choice

REPLICA_HEADER = "x-splitserve-replica"
PREFILL_REPLICA_HEADER = "x-splitserve-prefill-replica"


@dataclass(slots=True)
class Dispatch:
    stream: AsyncIterator[GenerateChunk]
    replicas: list[EngineClient]  # whose in-flight counts this request adds to
    outcome: PrefillOutcome
    headers: dict[str, str] = field(default_factory=dict)


class Dispatcher:
    def __init__(
        self,
        config: AppConfig,
        clients: list[EngineClient],
        release_transfer: Callable[[dict[str, Any]], None],
    ) -> None:
        self._disaggregated = config.strategy == "pd"
        self._pools: dict[str, list[EngineClient]] = {}
        for client in clients:
            self._pools.setdefault(client.role, []).append(client)
        self._choices: dict[str, ReplicaChoice] = {
            role: make_replica_choice(config.router.replica_choice) for role in self._pools
        }
        self._pd = PrefillDecodeFlow(release_transfer)

    def dispatch(self, request: GenerateRequest) -> Dispatch:
        if not self._disaggregated:
            replica = self._choose("mixed") or self._pools["mixed"][0]
            return Dispatch(
                stream=replica.generate(request),
                replicas=[replica],
                outcome=PrefillOutcome("local", "colocated"),
                headers={REPLICA_HEADER: replica.name},
            )
        # An unhealthy decode replica is skipped while another is healthy.
        decode = self._choose("decode") or self._pools["decode"][0]
        prefill = self._choose("prefill")
        outcome = PrefillOutcome("remote", "always")
        if prefill is None:
            outcome = PrefillOutcome("local", "prefill_unavailable")
        headers = {REPLICA_HEADER: decode.name}
        if prefill is not None:
            headers[PREFILL_REPLICA_HEADER] = prefill.name
        return Dispatch(
            stream=self._pd.run(request, decode, prefill, outcome),
            replicas=[decode] if prefill is None else [prefill, decode],
            outcome=outcome,
            headers=headers,
        )

    def _choose(self, role: str) -> EngineClient | None:
        """A healthy replica of the pool; None if none is (the caller decides what then)."""
        healthy = [replica for replica in self._pools.get(role, []) if replica.healthy]
        return self._choices[role].choose(healthy) if healthy else None
