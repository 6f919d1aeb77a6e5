"""dp.yaml served with synthetic engines (no model) and several router replicas, on a
Ray cluster of the test's own: what the router tests that need no model start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from deployments.launcher import ROUTER_DEPLOYMENT, RunningApp, serve_run
from tests.support.local_ports import free_port_run

DP_YAML = Path(__file__).resolve().parents[2] / "deployments" / "dp.yaml"


@contextlib.contextmanager
def synthetic_dp(
    folder: Path,
    routers: int,
    engine: dict[str, Any],
    router: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
) -> Iterator[RunningApp]:
    """Two synthetic engines (``engine``: the YAML's engine block) behind ``routers``
    router replicas, each on its own direct-ingress port; ``router`` updates the
    router block, and ``pool`` replaces the engine pool."""
    document = yaml.safe_load(DP_YAML.read_text())
    application = document["applications"][0]
    args = application["args"]
    args["engine"] = engine
    args["pools"] = [pool or {"role": "mixed", "replicas": 2}]
    args["router"].update(router or {})
    application["deployments"] = [{"name": ROUTER_DEPLOYMENT, "num_replicas": routers}]
    path = folder / "dp-synthetic.yaml"
    path.write_text(yaml.safe_dump(document))
    port = free_port_run(routers + 1)
    # "local": a cluster of this test's own, started by serve run and gone with it; the
    # session's cluster gives direct ingress a single port.
    with serve_run(str(path), ray_address="local", port=port, log_dir=folder) as app:
        yield app
