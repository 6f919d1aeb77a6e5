"""The launcher's direct-ingress settings: the proxy moved aside, the port waited for."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from deployments.config import load_application
from deployments.launcher import (
    LaunchError,
    cluster_env,
    direct_ingress_config,
    router_replicas,
    simulated_config,
    wait_until_bindable,
)
from tests.support.local_ports import free_port

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


def test_the_copy_moves_only_the_proxy_port() -> None:
    original = yaml.safe_load((DEPLOYMENTS / "pd.yaml").read_text())
    copy = yaml.safe_load(direct_ingress_config(DEPLOYMENTS / "pd.yaml", 8100).read_text())
    assert copy["http_options"]["port"] == 8101
    copy["http_options"]["port"] = original["http_options"]["port"]
    assert copy == original


def test_cluster_env_gives_the_router_exactly_its_port() -> None:
    env = cluster_env(8100)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's range is [min, max): one port.
    assert (
        env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
        env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"],
    ) == ("8100", "8101")


def test_router_replicas_take_consecutive_ports_and_the_proxy_the_next(tmp_path: Path) -> None:
    document = yaml.safe_load((DEPLOYMENTS / "dp.yaml").read_text())
    document["applications"][0]["deployments"] = [{"name": "Router", "num_replicas": 3}]
    path = tmp_path / "dp-three-routers.yaml"
    path.write_text(yaml.safe_dump(document))
    assert router_replicas(path) == 3
    assert router_replicas(DEPLOYMENTS / "dp.yaml") == 1
    env = cluster_env(8100, 3)
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8103"
    copy = yaml.safe_load(direct_ingress_config(path, 8100).read_text())
    assert copy["http_options"]["port"] == 8103


def test_waits_for_a_taken_port_and_gives_up_with_its_name() -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        with pytest.raises(LaunchError, match=f"port {port} stayed taken"):
            wait_until_bindable(port, timeout_s=1.5)
    wait_until_bindable(port, timeout_s=1.5)  # free again: returns at once


def test_a_gpu_yaml_simulated_asks_for_no_device(tmp_path: Path) -> None:
    """The advisor writes GPU YAMLs; simulated, their engines must start on a box
    without GPUs (a TP2 engine asks Ray for CPUs, not for two devices)."""
    document = yaml.safe_load((DEPLOYMENTS / "dp.yaml").read_text())
    args = document["applications"][0]["args"]
    args["accelerator"] = "gpu"
    args["pools"] = [{"role": "mixed", "replicas": 2, "tensor_parallel_size": 2}]
    gpu_yaml = tmp_path / "gpu.yaml"
    gpu_yaml.write_text(yaml.safe_dump(document))
    config = load_application(simulated_config(gpu_yaml, "h100-llama-3.1-8b")).models[0]
    assert config.accelerator == "cpu"
    assert config.engine.backend == "simulated"
    assert config.pools[0].tensor_parallel_size == 2  # its profile's TP2 member
