"""DP and PD across two Ray nodes on this machine (``deployments.local_nodes``), each
node with an object store of its own.

DP: one engine on each node (each node has one engine slot, and the pool asks for one),
the router on the head; greedy ids equal a single engine's and both engines answer.

PD: the prefill pool on one node, the decode pool (and the router) on the other, placed
by node labels (``placement.node_labels`` in the YAML). Checked: greedy token ids equal a
single engine's, the KV was handed over (our transfer metrics count the loads; on one
host it does not cross object stores, see the test), nothing is left in either store,
and killing the second node's raylet leaves the application
answering: every request gets its answer, and once Ray declares the node dead every
prompt is prefilled on the decode replica and nothing of the node is left running.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments.launcher import (
    ENGINE_PROCESS_MARKERS,
    RunningApp,
    replica_engine_pids,
    serve_run,
)
from deployments.local_nodes import LABEL, LocalCluster, NodeSpec, local_nodes, marked_pids
from splitserve.processes import command_lines
from tests.support.greedy import kv_metric, metric
from tests.support.served_apps import ServedApps
from tests.support.shared_apps import SharedModel, shared_app
from tests.support.shipped_configs import shipped_args

pytestmark = pytest.mark.serving

MODEL = "splitserve-tiny-llama"
ENGINE_SLOT = "splitserve_engine_slot"
_rng = random.Random(3)
PROMPTS = [[_rng.randrange(3, 256) for _ in range(n)] for n in (300, 700, 129, 1000, 513, 2)]
MAX_TOKENS = 8
KV_PAGE_BYTES = 128 * 2 * 2 * 2 * 32 * 4  # one block of the embedded model, fp32
# The GCS declares a node dead after five failed health checks, one every
# HEALTH_CHECK_PERIOD_MS here (Ray's default is 3 s: 15 s of the test); its processes
# then exit. Room for both on a busy two-core box.
HEALTH_CHECK_PERIOD_MS = 1000
NODE_DEATH_TIMEOUT_S = 90.0
# A Serve replica's process title; vLLM's engine processes are ENGINE_PROCESS_MARKERS.
REPLICA_TITLE = "ray::ServeReplica"


@pytest.fixture(scope="module")
def two_nodes(ray_address: str) -> Iterator[LocalCluster]:
    """A cluster of its own: the session's stays as it is for the other modules.
    Each node has one ENGINE_SLOT, so a pool placed on that resource spreads over both."""
    nodes = [NodeSpec(role, resources={ENGINE_SLOT: 1}) for role in ("decode", "prefill")]
    with local_nodes(nodes, health_check_period_ms=HEALTH_CHECK_PERIOD_MS) as cluster:
        yield cluster


def _placed(shipped: str, pools: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """A shipped YAML's overrides: each pool placed by ``pools``, and the entry point beside
    the decode pool (losing the prefill node must not take it)."""
    args = shipped_args(shipped)
    placed = [{**pool, "placement": pools(pool)} for pool in args["pools"]]
    return {"pools": placed, "router": {"placement": {"node_labels": {LABEL: "decode"}}}}


# dp.yaml with one engine per node (each takes the one ENGINE_SLOT its node has), and
# pd_always.yaml with its pools on the nodes of their role: one application, one start.
DP = SharedModel("dp-two-nodes", "dp", _placed("dp", lambda pool: {"resources": {ENGINE_SLOT: 1}}))
PD = SharedModel(
    "pd-two-nodes",
    "pd_always",
    _placed("pd_always", lambda pool: {"node_labels": {LABEL: pool["role"]}}),
)


@pytest.fixture(scope="module")
def placed_app(
    reference: list[list[int]], two_nodes: LocalCluster, serve_logs: Path
) -> Iterator[RunningApp]:
    path = shared_app(serve_logs, "two-nodes", {"dp": DP, "pd": PD})
    with serve_run(str(path), ray_address=two_nodes.address, log_dir=serve_logs) as app:
        yield app


def _complete(
    base_url: str, prompt: list[int], header: str = "x-splitserve-prefill", model: str = PD.name
) -> tuple[list[int], str]:
    """The greedy ids, and the response's ``header``: where the prompt was computed, or
    (x-splitserve-replica) which engine answered."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"], response.headers.get(header, "")


def _eventually(check: object, timeout_s: float = 40.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(1)
    return False


def _large_object_ids(dashboard_url: str) -> set[str]:
    """Objects in any store of the cluster at least one KV page big."""
    from ray.util.state import list_objects

    objects = list_objects(address=dashboard_url, limit=10_000, raise_on_missing_output=False)
    return {o.object_id for o in objects if (o.object_size or 0) >= KV_PAGE_BYTES}


def single_reference(base_url: str) -> list[list[int]]:
    """One engine's tokens for PROMPTS (asked by conftest's single_answers, in the
    session's cluster: greedy tokens do not depend on the cluster)."""
    return [_complete(base_url, prompt, model=MODEL)[0] for prompt in PROMPTS]


@pytest.fixture(scope="module")
def reference(single_answers: dict[str, Any], served_apps: ServedApps) -> list[list[int]]:
    served_apps.close()  # port 8000 and the cores are the two-node cluster's from now on
    return single_answers[__name__]


def test_dp_across_two_nodes(
    reference: list[list[int]], two_nodes: LocalCluster, placed_app: RunningApp
) -> None:
    """DP's engines on both nodes, reached through the same transport as on one node:
    round robin sends alternate requests across the nodes, and every answer is single's."""
    app = placed_app
    dp_engines = {DP.engine("mixed", 0), DP.engine("mixed", 1)}
    engine_nodes = {
        role
        for role in ("decode", "prefill")
        if any(_engine_commands(two_nodes.marker, role, engine) for engine in dp_engines)
    }
    assert engine_nodes == {"decode", "prefill"}, "dp's two engines did not spread over both nodes"
    answers = [_complete(app.base_url, p, "x-splitserve-replica", model=DP.name) for p in PROMPTS]
    assert [ids for ids, _ in answers] == reference
    assert len({engine for _, engine in answers}) == 2, answers


def test_pd_across_two_nodes(
    reference: list[list[int]], two_nodes: LocalCluster, placed_app: RunningApp
) -> None:
    app = placed_app
    # Serve keeps objects of its own (configs, handles): only new ones would be ours.
    baseline = _large_object_ids(two_nodes.dashboard_url)
    answers = [_complete(app.base_url, prompt) for prompt in PROMPTS]
    assert [ids for ids, _ in answers] == reference
    assert {where for _, where in answers} == {"remote:always"}
    metrics = f"{app.base_url}/metrics"
    assert kv_metric(metrics, "splitserve_kv_transfers_total", 5, outcome="loaded") >= 5
    assert kv_metric(metrics, "splitserve_kv_transfer_bytes_total", 1, op="get") > 0
    # Not asserted: that the bytes crossed object stores. With both nodes on one
    # host, each engine's KV connector joins Ray as a driver, and Ray attaches a
    # driver to the head node's raylet when several share the host; read against a
    # baseline, the decode node's object manager received no chunk during these
    # requests (2 before, 2 after, 40 s later). On separate machines each driver
    # has one raylet to attach to; not yet checked there.
    # Freed on both nodes once loaded.
    assert _eventually(lambda: metric(metrics, "splitserve_kv_transfer_live_transfers") == 0)
    assert _eventually(lambda: not _large_object_ids(two_nodes.dashboard_url) - baseline), (
        "KV objects left in an object store"
    )

    # The prefill node goes away: its raylet dies, its replica with it.
    node = _node_commands(two_nodes.marker)
    raylets = {pid for pid, command in node.items() if "raylet" in command}
    assert raylets, "no raylet found for the prefill node"
    decisions = "splitserve_prefill_decisions_total"
    local_before = metric(metrics, decisions, model=PD.name, where="local")
    for pid in raylets:
        os.kill(pid, signal.SIGKILL)
    # Ray's actor calls go worker to worker, so the replica may answer until the GCS
    # declares its node dead; every request is answered meanwhile, then all go local.
    assert _eventually(
        lambda: _complete(app.base_url, _fresh_prompt())[1].startswith("local:"),
        timeout_s=NODE_DEATH_TIMEOUT_S,
    ), "still prefilling on a dead node"
    after = [_complete(app.base_url, _fresh_prompt()) for _ in range(4)]
    assert all(where.startswith("local:") for _, where in after), after
    local_after = metric(metrics, decisions, model=PD.name, where="local")
    assert local_after - local_before >= len(after), (local_before, local_after)
    # No engine outlives its node: the replica and its engine core exit with the raylet.
    assert _eventually(
        lambda: not _replica_commands(two_nodes.marker), timeout_s=NODE_DEATH_TIMEOUT_S
    ), f"left running on the dead node: {_replica_commands(two_nodes.marker)}"


def _fresh_prompt() -> list[int]:
    return [_rng.randrange(3, 256) for _ in range(400)]


def _node_commands(marker: str, role: str = "prefill") -> dict[int, str]:
    pids = marked_pids(marker, role)
    return {pid: command for pid, command in command_lines().items() if pid in pids}


def _engine_commands(marker: str, role: str, engine: str) -> list[str]:
    """A node's vLLM engine processes of ``engine`` still running (Ray's own daemons, such
    as its log monitor, are the cluster's to stop; a replica's title alone is not an
    engine)."""
    mine = replica_engine_pids(engine)
    return [
        command[:120]
        for pid, command in _node_commands(marker, role).items()
        if pid in mine and any(title in command for title in ENGINE_PROCESS_MARKERS)
    ]


def _replica_commands(marker: str, role: str = "prefill") -> list[str]:
    """A node's Serve replicas and engine processes still running."""
    titles = (REPLICA_TITLE, *ENGINE_PROCESS_MARKERS)
    return [
        command[:120]
        for command in _node_commands(marker, role).values()
        if any(title in command for title in titles)
    ]
