"""The KubeRay manifest (deployments/kuberay/rayservice-pd.yaml) is a RayService whose
embedded Serve config is a valid splitserve application, and whose Ray node groups
carry the labels and GPUs its pools are placed on.

No RayService schema is packaged for offline use (KubeRay ships it as a CRD in its
Helm chart), so the structure is checked field by field here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deployments.config import parse_app_config, refuse_engine_overrides

MANIFEST = Path(__file__).resolve().parent.parent / "deployments" / "kuberay" / "rayservice-pd.yaml"


def _manifest() -> dict[str, Any]:
    return yaml.safe_load(MANIFEST.read_text())


def _groups(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def test_it_is_a_rayservice_for_our_ray_version() -> None:
    manifest = _manifest()
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


def test_the_embedded_application_is_valid(tmp_path: Path) -> None:
    serve_config = yaml.safe_load(_manifest()["spec"]["serveConfigV2"])
    (application,) = serve_config["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    config = parse_app_config(application["args"], origin=str(MANIFEST))
    assert (config.strategy, config.accelerator) == ("pd", "gpu")
    assert config.placed and not config.hosts_engines_in_router
    copy = tmp_path / "serve.yaml"
    copy.write_text(yaml.safe_dump(serve_config))
    refuse_engine_overrides(copy)  # no Serve override scales an engine


def test_every_pool_has_a_node_group_with_its_label_and_a_gpu_each() -> None:
    manifest = _manifest()
    application = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]
    config = parse_app_config(application["args"])
    groups = _groups(manifest["spec"]["rayClusterConfig"])
    for pool in config.pools:
        assert pool.placement is not None
        (label,) = pool.placement.node_labels.items()
        matching = [g for g in groups if g["rayStartParams"].get("labels") == "=".join(label)]
        assert matching, f"no node group carries {label} for the {pool.role} pool"
        for group in matching:
            (container,) = group["template"]["spec"]["containers"]
            gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
            assert gpus >= pool.ranks_per_replica * pool.replicas
    images = {g["template"]["spec"]["containers"][0]["image"] for g in groups}
    assert len(images) == 1, "every node runs the same splitserve image"
