"""The request router of a scaled pool's Serve deployment, in each router process.

Routers talk to engines over the engine transport, not through Serve's handle; the
handle is for control. For a scaled pool Serve's handle tells two things this class
turns into our terms:
- which replicas are running, as Serve adds and removes them (``update_replicas``),
  published to router/pool/members.py;
- and a control call that names a replica (``transport_address(replica=...)``) goes to
  that replica, so each pool member's link connects to its own engine.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

import router.pool.members as pool_members

# The keyword a control call names its replica by (EngineReplica.transport_address).
TARGET_KWARG = "replica"


class PoolMembership(FIFOMixin, RequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        pool_members.publish(
            self._deployment_id.name, [replica.replica_id.unique_id for replica in replicas]
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        wanted = _target(pending_request)
        if wanted is None:
            return [candidate_replicas]
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
        # Empty: Serve waits and asks again (the replica may not be running yet); the
        # caller bounds that wait.
        return [chosen] if chosen else []


def _target(pending_request: PendingRequest | None) -> Any:
    if pending_request is None:
        return None
    return pending_request.kwargs.get(TARGET_KWARG)
