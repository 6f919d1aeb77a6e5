"""The Kubernetes deployment (deployments/kuberay/) is one the cluster accepts as it stands.

- Both RayServices (PD, and auto_scaled.yaml's application under KubeRay's autoscaler)
  and the PodMonitor fit their CRDs' schemas (vendored, trimmed, in tests/data/kuberay/,
  with where they came from), and use no field the schema lacks: the API server drops
  or refuses those, so a misplaced field would vanish silently.
- The KubeRay operator's own rules that a schema cannot say hold; each check names the
  Go function of ray-operator/controllers/ray/ it mirrors (KubeRay master after
  v1.6.0-rc.0, and v1.7.0 for the replica bounds, autoscaler and token rules; the labels
  rule since v1.5).
- The embedded Serve configs are valid splitserve applications; no replica can land on
  the head and each has a worker group that can host it; every pod can become Ready.
- Clients reach the router through Serve's direct ingress, as under
  ``python -m deployments.serve``: every Ray container carries
  deployments.launcher.cluster_env(), Serve's proxy moves to proxy_port(), a Service of
  ours sends clients to the router's own port on the pods that may host it, and the
  PodMonitor scrapes the router there, once.
- Secrets: the HF token, the API keys and Ray's token come from Secrets that
  docs/KUBERNETES.md creates, only on the pods that use them; the model cache is
  mounted where HF_HOME points.
- The image builds in layers from a small context: dependencies before sources, base
  image matching pyproject.toml's pins, .dockerignore leaving out what a checkout grows.
"""

from __future__ import annotations

import copy
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.deployment import Deployment

from dashboards.prometheus import RAY_JOB, ROUTER_JOB
from deployments.app import build_app
from deployments.config import parse_app_config, refuse_engine_overrides
from deployments.launcher import DEFAULT_PORT, cluster_env, proxy_port, router_replicas
from router.http.auth import KEYS_ENV
from tests.support.shipped_configs import on_gpus

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "deployments" / "kuberay"
MANIFEST = KUBERAY / "rayservice-pd.yaml"
AUTO_SCALED = KUBERAY / "rayservice-auto-scaled.yaml"
MANIFESTS = [MANIFEST, AUTO_SCALED]
SECRET = KUBERAY / "hf-token-secret.yaml"
MODEL_CACHE = KUBERAY / "model-cache-pvc.yaml"
PODMONITOR = KUBERAY / "podmonitor.yaml"
GUIDE = REPO / "docs" / "KUBERNETES.md"
DOCKERFILE = KUBERAY / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "kuberay"
PROMETHEUS_CONFIG = REPO / "dashboards" / "prometheus.yml"

MAX_CONTEXT_BYTES = 20 * 1024 * 1024  # the build context docker sends, all files together
GPU = "nvidia.com/gpu"
INT32 = (-(2**31), 2**31 - 1)
TRIMMED, TRIMMED_PROPERTIES = "x-splitserve-trimmed", "x-splitserve-trimmed-properties"


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _documents(path: Path) -> list[dict[str, Any]]:
    """Every document of a multi-document YAML file, as `kubectl apply -f` reads it."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


def _manifest(path: Path = MANIFEST) -> dict[str, Any]:
    """The RayService of a manifest file (its other documents: _api_service)."""
    (rayservice,) = [d for d in _documents(path) if d.get("kind") == "RayService"]
    return rayservice


def _api_service(path: Path) -> dict[str, Any]:
    """The Service of ours, in the RayService's file, that clients reach the API by."""
    (service,) = [d for d in _documents(path) if d.get("kind") == "Service"]
    return service


each_manifest = pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.stem)


def _serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def _groups(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def _port(container: dict[str, Any], name: str) -> int | None:
    return next(
        (p["containerPort"] for p in container.get("ports", []) if p.get("name") == name), None
    )


def _args(manifest: dict[str, Any]) -> dict[str, Any]:
    (application,) = _serve_config(manifest)["applications"]
    return application["args"]


def _env(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in container.get("env", []) if e["name"] == name), None)


def _secret_ref(container: dict[str, Any], name: str) -> tuple[str, str] | None:
    """(Secret, key) an env var is read from; None if it is unset or not from a Secret."""
    env = _env(container, name)
    if env is None or "value" in env:
        return None
    ref = env.get("valueFrom", {}).get("secretKeyRef")
    return None if ref is None else (ref["name"], ref["key"])


# --- The CRD schemas -----------------------------------------------------------------


def _fields_outside(value: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    """Manifest fields the (trimmed) schema does not describe, and int32s out of range.

    A CRD's schema does not forbid unknown fields (no additionalProperties: false); the
    API server prunes them, or refuses them under kubectl's strict field validation.
    Either way a misplaced field is lost, so here it is an error.
    """
    if schema.get(TRIMMED):
        yield f"{path}: the vendored schema trimmed this subtree; vendor it to use it"
        return
    if isinstance(value, dict):
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if properties is not None and key in properties:
                yield from _fields_outside(item, properties[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from _fields_outside(item, extra, f"{path}.{key}")
            elif properties is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                trimmed = (
                    " (or trimmed from the vendored copy)" if schema.get(TRIMMED_PROPERTIES) else ""
                )
                yield f"{path}.{key}: no such field in the schema{trimmed}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            yield from _fields_outside(item, schema["items"], f"{path}[{index}]")
    elif (
        isinstance(value, int)
        and schema.get("format") == "int32"
        and not INT32[0] <= value <= INT32[1]
    ):
        yield f"{path}: {value} is not an int32"


def _schema_errors(document: dict[str, Any], schema_file: str) -> list[str]:
    # jsonschema comes with Ray (a dependency of ray itself), so it is always here.
    import jsonschema

    schema = _load(SCHEMAS / schema_file)
    validator = jsonschema.Draft7Validator(schema)
    errors = [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(document)
    ]
    return errors + list(_fields_outside(document, schema, "$"))


@each_manifest
def test_the_rayservice_fits_the_crd_schema(path: Path) -> None:
    manifest = _manifest(path)
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    assert _schema_errors(manifest, "rayservice-v1.schema.yaml") == []


def test_the_podmonitor_fits_its_crd_schema() -> None:
    monitor = _load(PODMONITOR)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert _schema_errors(monitor, "podmonitor-v1.schema.yaml") == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # A typo at the group level: the API server would drop it, and the labels with it.
        (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(label={}), "label"),
        # A field the vendored copy trimmed: vendor its schema before using it.
        (
            lambda m: _containers(m["spec"]["rayClusterConfig"]["headGroupSpec"])[0].update(
                securityContext={"runAsNonRoot": True}
            ),
            "trimmed",
        ),
        (
            lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(replicas="1"),
            "type",
        ),
        (lambda m: m["spec"]["rayClusterConfig"].pop("headGroupSpec"), "required"),
        # A volume kind the vendored copy leaves out (only emptyDir, hostPath, PVC).
        (
            lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"][
                "volumes"
            ][0].update(nfs={"server": "nfs", "path": "/"}),
            "trimmed",
        ),
        (
            lambda m: m["spec"]["rayClusterConfig"].update(authOptions={"mode": "password"}),
            "is not one of",
        ),
    ],
    ids=[
        "unknown-field",
        "trimmed-field",
        "wrong-type",
        "missing-required",
        "volume-kind",
        "auth-mode",
    ],
)
def test_the_schema_check_refuses_what_the_api_server_would(mutate: Any, expected: str) -> None:
    manifest = _manifest()
    mutate(manifest)
    errors = _schema_errors(manifest, "rayservice-v1.schema.yaml")
    assert errors and any(expected in error for error in errors), errors


# --- The operator's rules (ray-operator/controllers/ray/utils/validation.go) ---------

# MaxRayClusterNameLength (53, so that "<name>-serve-svc" fits 63 characters) minus the
# 6 characters KubeRay appends to name the RayService's cluster (constant.go).
MAX_RAYSERVICE_NAME_LENGTH = 53 - 6
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
UPGRADE_TYPES = ("NewClusterWithIncrementalUpgrade", "NewCluster", "None")


def validate_rayservice_metadata(metadata: dict[str, Any]) -> list[str]:
    """ValidateRayServiceMetadata: the name is a DNS-1035 label of at most 47 characters."""
    name = metadata.get("name", "")
    errors = []
    if len(name) > MAX_RAYSERVICE_NAME_LENGTH:
        errors.append(f"RayService name should be no more than {MAX_RAYSERVICE_NAME_LENGTH}")
    if len(name) > 63 or not DNS1035_LABEL.fullmatch(name):
        errors.append("RayService name should be a valid DNS1035 label")
    return errors


def _is_qualified_name(key: str) -> bool:
    """k8s.io/apimachinery's IsQualifiedName: [DNS-1123 subdomain prefix/]name."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and QUALIFIED_NAME.fullmatch(name) is not None


def _is_valid_label_value(value: str) -> bool:
    """k8s.io/apimachinery's IsValidLabelValue: empty, or a qualified name's name part."""
    return value == "" or (len(value) <= 63 and QUALIFIED_NAME.fullmatch(value) is not None)


def validate_ray_group_labels(group_name: str, group: dict[str, Any]) -> list[str]:
    """validateRayGroupLabels: Ray node labels in the top-level `labels`, in label syntax."""
    errors = []
    if "labels" in group.get("rayStartParams", {}):
        errors.append(
            f"rayStartParams['labels'] is not supported for {group_name} group; "
            "please use the top-level Labels field instead"
        )
    for key, value in group.get("labels", {}).items():
        if not _is_qualified_name(key):
            errors.append(f"invalid label key for {group_name} group: '{key}'")
        if not isinstance(value, str) or not _is_valid_label_value(value):
            errors.append(f"invalid label value for key '{key}' in {group_name} group: '{value}'")
    return errors


def validate_ray_group_resources(group_name: str, group: dict[str, Any]) -> list[str]:
    """validateRayGroupResources: resources in rayStartParams or in `resources`, not both."""
    params = group.get("rayStartParams", {})
    in_params = any(params.get(key) for key in ("num-cpus", "num-gpus", "memory", "resources"))
    if in_params and group.get("resources"):
        return [f"resource fields set in both rayStartParams and Resources for {group_name}"]
    return []


def _env_names(container: dict[str, Any]) -> dict[str, str | None]:
    return {env["name"]: env.get("value") for env in container.get("env", [])}


def validate_worker_group_replicas(group: dict[str, Any], autoscaling: bool) -> list[str]:
    """ValidateRayClusterSpec's replica bounds (v1.7.0): both set unless the autoscaler
    runs, neither negative, the minimum not above the maximum."""
    name, low, high = group["groupName"], group.get("minReplicas"), group.get("maxReplicas")
    errors = []
    if not autoscaling and (low is None or high is None):
        errors.append(f"worker group {name} must set both minReplicas and maxReplicas")
    if low is not None and low < 0:
        errors.append(f"worker group {name} has negative minReplicas {low}")
    if high is not None and high < 0:
        errors.append(f"worker group {name} has negative maxReplicas {high}")
    if low is not None and high is not None and low > high:
        errors.append(f"worker group {name} has minReplicas {low} greater than maxReplicas {high}")
    return errors


def validate_autoscaler(spec: dict[str, Any], head_env: dict[str, str | None]) -> list[str]:
    """ValidateRayClusterSpec's autoscaler rules (v1.7.0)."""
    errors = []
    options = spec.get("autoscalerOptions") or {}
    if spec.get("enableInTreeAutoscaling"):
        for group in spec.get("workerGroupSpecs", []):
            if group.get("suspend"):
                errors.append(f"worker group {group['groupName']} cannot be suspended")
        if options.get("version") is not None and "RAY_enable_autoscaler_v2" in head_env:
            errors.append("both .spec.autoscalerOptions.version and RAY_enable_autoscaler_v2")
        if options.get("version") == "v2":  # IsAutoscalingV2Enabled
            for group in _groups(spec):
                policy = group["template"]["spec"].get("restartPolicy", "")
                if policy not in ("", "Never"):
                    errors.append("restartPolicy should be Never or unset with autoscaler v2")
    if options.get("idleTimeoutSeconds", 0) < 0:
        errors.append("autoscalerOptions.idleTimeoutSeconds must be non-negative")
    return errors


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def validate_auth_options(spec: dict[str, Any]) -> list[str]:
    """ValidateRayClusterSpec's token rules (v1.7.0; IsAuthEnabled, IsK8sAuthEnabled)."""
    options = spec.get("authOptions") or {}
    k8s = bool(options.get("enableK8sTokenAuth"))
    if options.get("mode") != "token":
        return ["enableK8sTokenAuth is enabled but mode is not 'token'"] if k8s else []
    if not spec.get("rayVersion"):
        return ["authOptions.mode is 'token' but RayVersion was not specified"]
    errors = []
    if _version(spec["rayVersion"]) < (2, 52, 0):
        errors.append("authOptions.mode is 'token': Ray 2.52.0 or later is required")
    if k8s and _version(spec["rayVersion"]) < (2, 55, 0):
        errors.append("authOptions.enableK8sTokenAuth needs Ray 2.55.0 or later")
    if k8s and options.get("secretName"):
        errors.append("authOptions.enableK8sTokenAuth is enabled and secretName is also set")
    return errors


def validate_raycluster_spec(spec: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    """ValidateRayClusterSpec, the rules a RayService's rayClusterConfig can break."""
    head = spec["headGroupSpec"]
    if not _containers(head):
        return ["headGroupSpec should have at least one container"]
    errors = validate_ray_group_resources("Head", head) + validate_ray_group_labels("Head", head)
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))  # IsAutoscalingEnabled
    for group in spec.get("workerGroupSpecs", []):
        if not _containers(group):
            errors.append("workerGroupSpec should have at least one container")
            continue
        errors += validate_worker_group_replicas(group, autoscaling)
        errors += validate_ray_group_resources(group["groupName"], group)
        errors += validate_ray_group_labels(group["groupName"], group)
        if group.get("suspend"):  # needs the RayJobDeletionPolicy feature gate, off by default
            errors.append(f"worker group {group['groupName']} can be suspended only with a gate")
    # The Ray container is the first one (RayContainerIndex).
    head_env = _env_names(_containers(head)[0])
    ft_options = spec.get("gcsFaultToleranceOptions")
    if annotations.get("ray.io/ft-enabled") and ft_options is not None:
        errors.append("ray.io/ft-enabled annotation and GcsFaultToleranceOptions are both set")
    gcs_ft = annotations.get("ray.io/ft-enabled", "").lower() == "true" or ft_options is not None
    if not gcs_ft and "RAY_REDIS_ADDRESS" in head_env:
        errors.append("RAY_REDIS_ADDRESS is set but GcsFaultToleranceOptions is not")
    if head.get("rayStartParams", {}).get("redis-username") or "REDIS_USERNAME" in head_env:
        errors.append("cannot set redis username in rayStartParams or environment variables")
    if not autoscaling and head_env.get("RAY_enable_autoscaler_v2") in ("1", "true"):
        errors.append(
            "RAY_enable_autoscaler_v2 cannot be set when enableInTreeAutoscaling is false"
        )
    return errors + validate_autoscaler(spec, head_env) + validate_auth_options(spec)


def validate_rayservice_spec(rayservice: dict[str, Any]) -> list[str]:
    """ValidateRayServiceSpec (which runs ValidateRayClusterSpec first)."""
    spec = rayservice["spec"]
    cluster = spec["rayClusterConfig"]
    errors = []
    if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth"):
        errors.append("K8s token auth mode is currently not supported for RayService")
    errors += validate_raycluster_spec(cluster, rayservice["metadata"].get("annotations", {}))
    if cluster["headGroupSpec"].get("headService", {}).get("metadata", {}).get("name"):
        errors.append(
            "spec.rayClusterConfig.headGroupSpec.headService.metadata.name should not be set"
        )
    strategy = spec.get("upgradeStrategy") or {}
    if strategy.get("type") is not None and strategy["type"] not in UPGRADE_TYPES:
        errors.append(f"Spec.UpgradeStrategy.Type value {strategy['type']} is invalid")
    if spec.get("rayClusterDeletionDelaySeconds", 0) < 0:
        errors.append("Spec.RayClusterDeletionDelaySeconds should be a non-negative integer")
    if strategy.get("type") == "NewClusterWithIncrementalUpgrade":  # ValidateClusterUpgradeOptions
        options = strategy.get("clusterUpgradeOptions")
        if not cluster.get("enableInTreeAutoscaling"):
            errors.append("Ray Autoscaler is required for NewClusterWithIncrementalUpgrade")
        elif options is None:
            errors.append("ClusterUpgradeOptions are required for NewClusterWithIncrementalUpgrade")
        elif not options.get("gatewayClassName"):
            errors.append("gatewayClassName is required for NewClusterWithIncrementalUpgrade")
    return errors


@each_manifest
def test_the_operator_accepts_the_rayservice(path: Path) -> None:
    manifest = _manifest(path)
    assert validate_rayservice_metadata(manifest["metadata"]) == []
    assert validate_rayservice_spec(manifest) == []


def _cluster(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["rayClusterConfig"]


def _group(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    (group,) = [g for g in _cluster(manifest)["workerGroupSpecs"] if g["groupName"] == name]
    return group


@pytest.mark.parametrize(
    ("path", "mutate", "expected"),
    [
        (MANIFEST, lambda m: _group(m, "prefill").pop("maxReplicas"), "must set both"),
        (AUTO_SCALED, lambda m: _group(m, "engine").update(minReplicas=5), "greater than"),
        (AUTO_SCALED, lambda m: _group(m, "engine").update(minReplicas=-1), "negative"),
        (
            AUTO_SCALED,
            lambda m: (
                _containers(_cluster(m)["headGroupSpec"])[0]
                .setdefault("env", [])
                .append({"name": "RAY_enable_autoscaler_v2", "value": "1"})
            ),
            "both .spec.autoscalerOptions.version",
        ),
        (
            AUTO_SCALED,
            lambda m: _group(m, "engine")["template"]["spec"].update(restartPolicy="Always"),
            "restartPolicy",
        ),
        (
            AUTO_SCALED,
            lambda m: _cluster(m)["autoscalerOptions"].update(idleTimeoutSeconds=-1),
            "idleTimeoutSeconds",
        ),
        (MANIFEST, lambda m: _cluster(m).update(rayVersion="2.51.0"), "2.52.0"),
        (
            MANIFEST,
            lambda m: _cluster(m)["authOptions"].update(enableK8sTokenAuth=True),
            "not supported for RayService",
        ),
    ],
    ids=[
        "bounds-unset",
        "min-above-max",
        "negative-min",
        "autoscaler-version-twice",
        "v2-restart-policy",
        "negative-idle-timeout",
        "token-needs-ray-2.52",
        "k8s-token-on-rayservice",
    ],
)
def test_the_operator_rules_refuse_what_kuberay_refuses(
    path: Path, mutate: Any, expected: str
) -> None:
    manifest = _manifest(path)
    mutate(manifest)
    errors = validate_rayservice_spec(manifest)
    assert any(expected in error for error in errors), errors


@each_manifest
def test_ray_node_labels_are_in_the_field_kuberay_reads_them_from(path: Path) -> None:
    """validateRayGroupLabels refuses rayStartParams['labels'] since KubeRay 1.5: the
    labels belong in each group's top-level `labels`, which KubeRay passes to ray start."""
    manifest = _manifest(path)
    for group in _groups(_cluster(manifest)):
        assert "labels" not in group["rayStartParams"]
    for group in _cluster(manifest)["workerGroupSpecs"]:
        assert group["labels"], "each worker group carries the label its replicas select"
    # The form KubeRay refuses, as an earlier manifest had it, is caught here.
    refused = _manifest(path)
    head = _cluster(refused)["headGroupSpec"]
    head["rayStartParams"]["labels"] = "splitserve-pool=decode"
    errors = validate_rayservice_spec(refused)
    assert any("rayStartParams['labels'] is not supported for Head group" in e for e in errors)


@pytest.mark.parametrize(
    ("labels", "valid"),
    [
        ({"splitserve-pool": "decode"}, True),
        ({"example.com/splitserve-pool": "prefill"}, True),
        ({"splitserve-pool": ""}, True),
        ({"splitserve pool": "decode"}, False),
        ({"splitserve-pool": "pre fill"}, False),
        ({"splitserve-pool": "-decode"}, False),
        ({"Example.com/pool": "decode"}, False),
        ({"splitserve-pool": "x" * 64}, False),
    ],
)
def test_the_label_rule_is_kubernetes_label_syntax(labels: dict[str, str], valid: bool) -> None:
    assert (validate_ray_group_labels("prefill", {"labels": labels}) == []) is valid


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("splitserve-pd", True),
        ("a" * 47, True),
        ("a" * 48, False),
        ("Splitserve", False),
        ("1pd", False),
        ("pd-", False),
    ],
)
def test_the_name_rule(name: str, valid: bool) -> None:
    assert (validate_rayservice_metadata({"name": name}) == []) is valid


@each_manifest
def test_the_serve_config_survives_the_operators_yaml_to_json(path: Path) -> None:
    """updateServeDeployment (rayservice_controller.go) unmarshals serveConfigV2 as YAML
    into a map and sends it to Ray's dashboard as JSON: keys must be strings throughout."""

    def string_keys(value: Any) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and string_keys(v) for k, v in value.items())
        if isinstance(value, list):
            return all(string_keys(item) for item in value)
        return True

    serve_config = _serve_config(_manifest(path))
    assert isinstance(serve_config, dict) and string_keys(serve_config)
    json.dumps(serve_config)


@each_manifest
def test_the_upgrade_strategy_is_chosen_not_defaulted(path: Path) -> None:
    """None: cluster changes wait for a restart instead of a second cluster's GPUs.

    The default, NewCluster, starts a whole second cluster (as many GPUs again) for any
    change to rayClusterConfig; the incremental strategy needs the autoscaler and a
    Gateway. serveConfigV2 changes are applied in place under every strategy.
    """
    spec = _manifest(path)["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}


# --- The application and the cluster it runs on ---------------------------------------


@each_manifest
def test_it_is_a_rayservice_for_our_ray_version(path: Path) -> None:
    manifest = _manifest(path)
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == _pins()["ray"]


def test_the_embedded_applications_are_valid(tmp_path: Path) -> None:
    expected = {MANIFEST: ("pd", False), AUTO_SCALED: ("auto", True)}
    for path, (shape, scaled) in expected.items():
        serve_config = _serve_config(_manifest(path))
        (application,) = serve_config["applications"]
        assert application["import_path"] == "deployments.app:build_app"
        config = parse_app_config(application["args"], origin=str(path))
        assert (config.shape, config.accelerator, config.scaled) == (shape, "gpu", scaled)
        assert config.placed and not config.hosts_engines_in_router
        copy_ = tmp_path / f"{path.stem}.yaml"
        copy_.write_text(yaml.safe_dump(serve_config))
        refuse_engine_overrides(copy_)  # no Serve override scales an engine


# What KubeRay starts Ray with on a pod (generateRayStartCommand, common/pod.go): its CPUs
# from rayStartParams' num-cpus, else the container's CPU limit, else its request; its
# GPUs from num-gpus, else the nvidia.com/gpu limit (addWellKnownAcceleratorResources);
# its labels from the group's `labels`.


def _quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _ray_node(group: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    params = group.get("rayStartParams", {})
    resources = _containers(group)[0].get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    cpus = params.get("num-cpus", limits.get("cpu") or requests.get("cpu", 0))
    gpus = params.get("num-gpus", limits.get(GPU, 0))
    return {"CPU": _quantity(cpus), "GPU": _quantity(gpus)}, group.get("labels", {})


def _can_host(group: dict[str, Any], actor_options: dict[str, Any]) -> bool:
    """Ray can place a replica with these options on the group's node: every resource it
    asks for is there, and every label it selects."""
    resources, labels = _ray_node(group)
    wanted = {
        "CPU": actor_options["num_cpus"],
        "GPU": actor_options.get("num_gpus", 0),
        **actor_options.get("resources", {}),
    }
    enough = all(resources.get(name, 0) >= amount for name, amount in wanted.items() if amount)
    selected = actor_options.get("label_selector", {}).items() <= labels.items()
    return enough and selected


def _replica_options(args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each Serve deployment the application builds (router, engines, scaled pools) and
    the Ray options its replicas are placed by."""

    def placed_by(deployment: Deployment) -> dict[str, Any]:
        assert deployment.ray_actor_options is not None, deployment.name
        return deployment.ray_actor_options

    router = build_app(copy.deepcopy(args))._bound_deployment
    options = {"Router": placed_by(router)}
    for binding in router.init_args[0]:
        deployments = {**binding.engines, **binding.pool_handles}
        options.update(
            {name: placed_by(app._bound_deployment) for name, app in deployments.items()}
        )
    return options


@each_manifest
def test_no_replica_can_land_on_the_head(path: Path) -> None:
    """The head offers Ray no CPU (num-cpus 0) and no GPU: the router and the engines run
    on worker pods, each of which some worker group can host, and the head keeps its
    CPUs for GCS, the dashboard and Serve's controller. By resources alone, whatever the
    replicas' label selectors say, so that a replica placed by no label stays off too."""
    manifest = _manifest(path)
    head = _cluster(manifest)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert GPU not in _containers(head)[0]["resources"]["limits"]
    assert "num-gpus" not in head["rayStartParams"]
    replicas = _replica_options(_args(manifest))
    assert "Router" in replicas and len(replicas) >= 2
    for name, options in replicas.items():
        unplaced = {k: v for k, v in options.items() if k != "label_selector"}
        assert not _can_host(head, unplaced), f"{name} could be placed on the head"
        hosts = [g for g in _cluster(manifest)["workerGroupSpecs"] if _can_host(g, options)]
        assert hosts, f"no worker group can host {name}: {options}"
    # Without num-cpus 0 Ray would take the head's CPU limit, and a router placed by no
    # label could land there.
    unlimited = copy.deepcopy(head)
    del unlimited["rayStartParams"]["num-cpus"]
    router = {k: v for k, v in replicas["Router"].items() if k != "label_selector"}
    assert _can_host(unlimited, router)


@each_manifest
def test_every_pool_has_a_node_group_with_its_label_and_a_gpu_each(path: Path) -> None:
    manifest = _manifest(path)
    config = parse_app_config(_args(manifest))
    groups = _cluster(manifest)["workerGroupSpecs"]
    for pool in config.pools:
        assert pool.placement is not None
        wanted = pool.placement.node_labels
        matching = [g for g in groups if wanted.items() <= g.get("labels", {}).items()]
        assert matching, f"no node group carries {wanted} for the {pool.role} pool"
        for group in matching:
            (container,) = _containers(group)
            gpus = int(container["resources"]["limits"][GPU])
            assert gpus >= pool.ranks_per_replica
            # Enough pods, at their most, for the pool at its most.
            assert gpus * group["maxReplicas"] >= pool.ranks_per_replica * pool.most_replicas
    images = {_containers(g)[0]["image"] for g in _groups(_cluster(manifest))}
    assert len(images) == 1, "every node runs the same splitserve image"


def test_the_autoscaler_sizes_the_engine_group_as_serve_sizes_the_pool() -> None:
    """KubeRay's in-tree autoscaler (v2, which reads label selectors) adds an engine pod
    for each engine Serve adds, between the same bounds: one GPU per engine, so the
    group's minReplicas/maxReplicas are the pool's min_replicas/max_replicas. The other
    groups hold still (the router's pod is never given back)."""
    manifest = _manifest(AUTO_SCALED)
    cluster = _cluster(manifest)
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["version"] == "v2"
    config = parse_app_config(_args(manifest))
    (pool,) = config.pools
    assert pool.autoscaling is not None and pool.placement is not None
    for group in cluster["workerGroupSpecs"]:
        if pool.placement.node_labels.items() <= group["labels"].items():
            per_pod = int(_containers(group)[0]["resources"]["limits"][GPU])
            assert per_pod == pool.ranks_per_replica
            assert (group["minReplicas"], group["maxReplicas"]) == (
                pool.autoscaling.min_replicas,
                pool.autoscaling.max_replicas,
            )
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        else:
            assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]
    # The PD manifest's groups are fixed: no autoscaler would change them.
    assert not _cluster(_manifest(MANIFEST)).get("enableInTreeAutoscaling")


def test_the_auto_scaled_rayservice_runs_auto_scaled_yaml() -> None:
    """Its application is deployments/auto_scaled.yaml's, changed only as that file's
    header says for GPUs (tests/support/shipped_configs.on_gpus, a Hugging Face model,
    max_replicas raised) and by what Kubernetes adds (placement, API keys)."""
    ours = copy.deepcopy(_args(_manifest(AUTO_SCALED)))
    shipped = on_gpus("auto_scaled")
    assert ours.pop("auth")["keys"]
    ours["router"].pop("placement")
    (pool,), (shipped_pool,) = ours["pools"], shipped["pools"]
    pool.pop("placement")
    assert pool["autoscaling"]["max_replicas"] >= shipped_pool["autoscaling"]["max_replicas"]
    pool["autoscaling"]["max_replicas"] = shipped_pool["autoscaling"]["max_replicas"]
    assert shipped["model"]["source"] == "embedded" != ours["model"]["source"]
    ours["model"]["source"] = shipped["model"]["source"]
    # Each model's own tool parser: Llama 3.x's there, the embedded model's here.
    assert ours["model"]["tool_call_parser"] == "llama3_json"
    ours["model"]["tool_call_parser"] = shipped["model"]["tool_call_parser"]
    assert ours == shipped


# --- Serve's direct ingress, readiness and the client Service -------------------------

# Ray's dashboard agent: its /api/healthz answers 200 while the node's raylet is healthy,
# the probe KubeRay gives workers outside a RayService on Ray >= 2.53
# (initLivenessAndReadinessProbe, supportsUnifiedHealthCheck; utils/constant.go's
# DefaultDashboardAgentListenPort and RayNodeHealthPath).
DASHBOARD_AGENT_PORT, RAY_NODE_HEALTH_PATH = 52365, "/api/healthz"
ENABLE_DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_HTTP_PORT = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_HTTP_PORT = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"


def _router_replicas(manifest: dict[str, Any], folder: Path) -> int:
    """deployments.launcher.router_replicas of the embedded Serve config."""
    copy_ = folder / f"{manifest['metadata']['name']}.serve.yaml"
    copy_.write_text(yaml.safe_dump(_serve_config(manifest)))
    return router_replicas(copy_)


def _expected_env(manifest: dict[str, Any], folder: Path) -> dict[str, str]:
    return cluster_env(DEFAULT_PORT, _router_replicas(manifest, folder))


def _serve_env(container: dict[str, Any]) -> dict[str, str | None]:
    """The container's RAY_SERVE_* variables, name to value."""
    return {k: v for k, v in _env_names(container).items() if k.startswith("RAY_SERVE_")}


def _direct_ingress_ports(container: dict[str, Any]) -> range:
    """The HTTP ports Serve's controller hands ingress replicas (node_port_manager.py:
    range(MIN, MAX), MAX excluded), from the container's environment."""
    env = _env_names(container)
    return range(int(env[MIN_HTTP_PORT] or 0), int(env[MAX_HTTP_PORT] or 0))


def _router_hosts(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The worker groups whose pods Ray could place the router on."""
    router = _replica_options(_args(manifest))["Router"]
    return [g for g in _cluster(manifest)["workerGroupSpecs"] if _can_host(g, router)]


def _pod_labels(group: dict[str, Any]) -> dict[str, str]:
    """A pod's labels: its template's and the ones KubeRay adds (common/pod.go)."""
    head = "groupName" not in group
    return group["template"]["metadata"]["labels"] | {
        "ray.io/node-type": "head" if head else "worker",
        "ray.io/group": "headgroup" if head else group["groupName"],
    }


@each_manifest
def test_every_ray_container_carries_cluster_env(path: Path, tmp_path: Path) -> None:
    """Serve reads its direct-ingress settings from the environment of the process that
    reads them (ray/serve/_private/constants.py, at import): Serve's controller on the
    head (all five: controller.py, node_port_manager.py, deployment_state.py,
    deploy_utils.py) and each replica on its worker (ENABLE and the drain: replica.py).
    Ray's processes inherit the container's environment, so every Ray container carries
    exactly what `python -m deployments.serve` starts its cluster with."""
    manifest = _manifest(path)
    expected = _expected_env(manifest, tmp_path)
    assert expected[ENABLE_DIRECT_INGRESS] == "1"
    for group in _groups(_cluster(manifest)):
        container = _containers(group)[0]  # the Ray container (RayContainerIndex)
        assert _serve_env(container) == expected, group.get("groupName", "head")
    # Ray 2.60 reads each of these names (a rename in a Ray upgrade would leave a
    # variable that nothing reads).
    spec = importlib.util.find_spec("ray.serve._private.constants")
    assert spec is not None and spec.origin is not None
    constants = Path(spec.origin).read_text()
    for name in expected:
        assert f'"{name}"' in constants, f"Ray's Serve no longer reads {name}"


@each_manifest
def test_serves_proxy_leaves_the_routers_port(path: Path, tmp_path: Path) -> None:
    """Under direct ingress the router takes the port range's one port (8000) and Serve's
    controller keeps its proxy on the head only (controller.py), at http_options.port:
    proxy_port(8000), outside the range. The router's own server binds
    http_options.host (replica.py), which must be every interface: the client Service
    reaches it on the pod's address, KubeRay's probe on localhost."""
    manifest = _manifest(path)
    serve_config = _serve_config(manifest)
    replicas = _router_replicas(manifest, tmp_path)
    http_options = serve_config["http_options"]
    assert http_options["port"] == proxy_port(DEFAULT_PORT, replicas)
    assert http_options["host"] == "0.0.0.0"
    assert serve_config["proxy_location"] == "HeadOnly"  # what the controller sets anyway
    for group in _groups(_cluster(manifest)):
        container = _containers(group)[0]
        ports = _direct_ingress_ports(container)
        assert list(ports) == list(range(DEFAULT_PORT, DEFAULT_PORT + replicas))
        assert http_options["port"] not in ports
        # No other port of the pod in the range, and Ray's worker ports (10002-19999
        # unless rayStartParams say otherwise) above it (replica.py's advice).
        others = [p["containerPort"] for p in container["ports"] if p.get("name") != "serve"]
        assert not set(others) & set(ports), others
        assert "min-worker-port" not in group["rayStartParams"] and ports.stop <= 10002


def never_ready(manifest: dict[str, Any]) -> list[str]:
    """The worker groups whose pods could never turn Ready, and why.

    KubeRay gives each RayService worker a readiness probe unless its Ray container has
    one (initLivenessAndReadinessProbe, common/pod.go): the raylet's health and `wget
    localhost:<port named serve, else 8000>/-/healthz | grep success`. Under direct
    ingress no worker runs Serve's proxy (controller.py: HeadOnly), and the only thing
    that answers /-/healthz on a worker is the router on its direct-ingress port
    (replica.py's _direct_ingress_asgi: "success", 503 while draining). So a group left
    to KubeRay's probe must be able to host the router, on that port, with a router for
    each of its pods; any other group needs a probe of its own, on the raylet's health.
    """
    cluster = _cluster(manifest)
    head = _containers(cluster["headGroupSpec"])[0]
    if _env_names(head).get(ENABLE_DIRECT_INGRESS) != "1":
        return ["Serve's direct ingress is off: these rules do not apply"]
    router_ports = _direct_ingress_ports(head)  # Serve's controller allocates them
    hosts = _router_hosts(manifest)
    problems = []
    for group in cluster["workerGroupSpecs"]:
        name, container = group["groupName"], _containers(group)[0]
        probe = container.get("readinessProbe")
        if probe is not None:
            params = group["rayStartParams"]
            agent = int(params.get("dashboard-agent-listen-port", DASHBOARD_AGENT_PORT))
            get = probe.get("httpGet") or {}
            if (get.get("path"), get.get("port"), get.get("host")) != (
                RAY_NODE_HEALTH_PATH,
                agent,
                None,
            ):
                problems.append(f"{name}: its own probe does not ask the raylet's health")
            continue
        if group not in hosts:
            problems.append(f"{name}: KubeRay's probe asks /-/healthz, nothing answers it")
        elif (_port(container, "serve") or 8000) not in router_ports:
            problems.append(f"{name}: KubeRay's probe asks a port the router does not take")
    return problems


@each_manifest
def test_every_pod_can_become_ready(path: Path, tmp_path: Path) -> None:
    """The router's pods are Ready while the router answers its own /-/healthz (KubeRay's
    probe); the others on their raylet's health (a probe of ours). The RayService turns
    Ready once its serve service has a Ready endpoint (NonZeroServeEndpoints,
    rayservice_controller.go), which the router's pod is once the router runs."""
    manifest = _manifest(path)
    assert never_ready(manifest) == []
    hosts = _router_hosts(manifest)
    assert hosts
    # One router per pod that may host it: no such pod waits for a router forever.
    replicas = _router_replicas(manifest, tmp_path)
    assert sum(g["maxReplicas"] for g in hosts) <= replicas
    for group in hosts:
        assert "readinessProbe" not in _containers(group)[0], "KubeRay's probe asks the router"
    # BuildServeService (common/service.go) refuses a head without a port named serve;
    # the head's is Serve's proxy. The head stays out of the serve service (whose port
    # no worker listens on), so no request takes the proxy's path by chance.
    cluster = _cluster(manifest)
    head = _containers(cluster["headGroupSpec"])[0]
    assert _port(head, "serve") == _serve_config(manifest)["http_options"]["port"]
    assert manifest["spec"]["excludeHeadPodFromServeSvc"] is True


@pytest.mark.parametrize(
    ("path", "mutate", "expected"),
    [
        (MANIFEST, lambda m: _containers(_group(m, "prefill"))[0].pop("readinessProbe"), "prefill"),
        (
            MANIFEST,
            lambda m: next(
                p for p in _containers(_group(m, "decode"))[0]["ports"] if p["name"] == "serve"
            ).update(containerPort=8001),
            "decode",
        ),
        (
            AUTO_SCALED,
            lambda m: _containers(_group(m, "engine"))[0]["readinessProbe"]["httpGet"].update(
                path="/-/healthz"
            ),
            "engine",
        ),
        (
            AUTO_SCALED,
            lambda m: _containers(_cluster(m)["headGroupSpec"])[0]["env"].pop(0),
            "direct ingress is off",
        ),
    ],
    ids=["prefill-left-to-kuberay", "decode-probe-port", "engine-probe-path", "no-direct-ingress"],
)
def test_the_readiness_rule_catches_a_pod_that_never_turns_ready(
    path: Path, mutate: Any, expected: str
) -> None:
    manifest = _manifest(path)
    mutate(manifest)
    problems = never_ready(manifest)
    assert any(expected in problem for problem in problems), problems


@each_manifest
def test_clients_reach_the_routers_own_port_through_our_service(path: Path, tmp_path: Path) -> None:
    """The Service in the RayService's file selects exactly the pods that may host the
    router (none of the other application's, not the head) and sends port 8000 to the
    router's direct-ingress port there: no Serve proxy between a client and the router.
    KubeRay's serve service would not do: it sends to every worker (ray.io/serve=true)."""
    manifest = _manifest(path)
    service = _api_service(path)
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    name = service["metadata"]["name"]
    assert len(name) <= 63 and DNS1035_LABEL.fullmatch(name)
    assert name not in {f"{manifest['metadata']['name']}-{s}" for s in ("head-svc", "serve-svc")}
    spec = service["spec"]
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    selector = spec["selector"]
    hosts = _router_hosts(manifest)
    everyone = [(p, g) for p in MANIFESTS for g in _groups(_cluster(_manifest(p)))]
    selected = [(p, g) for p, g in everyone if selector.items() <= _pod_labels(g).items()]
    assert selected == [(path, g) for g in hosts]
    (port,) = spec["ports"]
    assert port["port"] == DEFAULT_PORT
    router_port = int(_expected_env(manifest, tmp_path)[MIN_HTTP_PORT])
    for group in hosts:
        container = _containers(group)[0]
        target = port["targetPort"]
        resolved = _port(container, target) if isinstance(target, str) else target
        assert resolved == router_port
        assert router_port in _direct_ingress_ports(container)


def _kept(endpoint: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether the endpoint's `keep` relabelings keep a pod with these labels (Prometheus:
    source label values joined by ';', the regex anchored at both ends)."""
    for rule in endpoint.get("relabelings", []):
        if rule.get("action") != "keep":
            continue
        values = []
        for source in rule["sourceLabels"]:
            prefix = "__meta_kubernetes_pod_label_"
            assert source.startswith(prefix), source
            wanted = source[len(prefix) :]
            values.append(
                next((v for k, v in labels.items() if re.sub(r"\W", "_", k) == wanted), "")
            )
        if not re.fullmatch(rule.get("regex", "(.*)"), ";".join(values)):
            return False
    return True


def test_the_podmonitor_scrapes_each_router_once_on_its_own_port(tmp_path: Path) -> None:
    """The router's /metrics through the router's own port, not Serve's proxy: the
    PodMonitor keeps exactly the pods that may host the router, of both applications,
    where its port is the direct-ingress port; one such pod per router, so each router is
    scraped once."""
    monitor = _load(PODMONITOR)
    (router,) = [
        e
        for e in monitor["spec"]["podMetricsEndpoints"]
        if {"targetLabel": "job", "replacement": ROUTER_JOB} in e["relabelings"]
    ]
    for path in MANIFESTS:
        manifest = _manifest(path)
        hosts = _router_hosts(manifest)
        scraped = [
            g
            for g in _groups(_cluster(manifest))
            if _kept(router, _pod_labels(g)) and _port(_containers(g)[0], router["port"])
        ]
        assert scraped == hosts, path.stem
        router_port = int(_expected_env(manifest, tmp_path)[MIN_HTTP_PORT])
        for group in scraped:
            assert _port(_containers(group)[0], router["port"]) == router_port
        assert sum(g["maxReplicas"] for g in scraped) == _router_replicas(manifest, tmp_path)


# --- Secrets and the model cache -------------------------------------------------------


@each_manifest
def test_the_hugging_face_token_comes_from_the_secret(path: Path) -> None:
    """Every worker pod loads the model or its tokenizer and reads HF_TOKEN from the
    Secret (hf-token-secret.yaml's name and key); the head loads none and has no token."""
    secret = _load(SECRET)
    assert (secret["apiVersion"], secret["kind"]) == ("v1", "Secret")
    (key,) = secret["stringData"]
    placeholder = secret["stringData"][key]
    assert not placeholder.startswith("hf_"), "the template must not hold a real token"
    cluster = _cluster(_manifest(path))
    for group in cluster["workerGroupSpecs"]:
        for container in _containers(group):
            assert _secret_ref(container, "HF_TOKEN") == (secret["metadata"]["name"], key)
            assert "value" not in _env(container, "HF_TOKEN")  # type: ignore[operator]
    assert _env(_containers(cluster["headGroupSpec"])[0], "HF_TOKEN") is None
    assert _excluded(SECRET.relative_to(REPO).as_posix(), _dockerignore())


@each_manifest
def test_the_api_keys_come_from_a_secret_on_the_routers_pods_only(path: Path) -> None:
    """The router reads SPLITSERVE_API_KEYS and every auth.keys[].key_env in its own
    process, which inherits its pod's environment: on every pod that can host the router
    each comes from a Secret, on no other pod is any set, and the YAML holds no key."""
    manifest = _manifest(path)
    args = _args(manifest)
    auth = args["auth"]
    assert all("key" not in key and key["key_env"] for key in auth["keys"])
    variables = [KEYS_ENV, *(key["key_env"] for key in auth["keys"])]
    router = _replica_options(args)["Router"]
    cluster = _cluster(manifest)
    hosts = [g for g in cluster["workerGroupSpecs"] if _can_host(g, router)]
    assert hosts
    for group in _groups(cluster):
        container = _containers(group)[0]
        for variable in variables:
            if group in hosts:
                assert _secret_ref(container, variable), f"{variable} on {group.get('groupName')}"
            else:
                assert _env(container, variable) is None, f"{variable} where no router runs"


def test_prometheus_sends_the_key_that_opens_metrics_only() -> None:
    """With keys configured the router's /metrics asks for one: the PodMonitor sends the
    Secret's key that both applications read as a key allowed /metrics and nothing else."""
    monitor = _load(PODMONITOR)
    (router,) = [
        e
        for e in monitor["spec"]["podMetricsEndpoints"]
        if {"targetLabel": "job", "replacement": ROUTER_JOB} in e["relabelings"]
    ]
    credentials = router["authorization"]["credentials"]
    assert router["authorization"]["type"] == "Bearer"
    for path in MANIFESTS:
        manifest = _manifest(path)
        auth = _args(manifest)["auth"]
        assert "/metrics" not in auth["open_paths"], "an open /metrics needs no key"
        (key,) = [k for k in auth["keys"] if k["routes"] == ["/metrics"]]
        reference = (credentials["name"], credentials["key"])
        router = _replica_options(_args(manifest))["Router"]
        router_pods = [g for g in _cluster(manifest)["workerGroupSpecs"] if _can_host(g, router)]
        assert router_pods
        for group in router_pods:
            assert _secret_ref(_containers(group)[0], key["key_env"]) == reference


def test_the_ray_dashboard_asks_for_a_token() -> None:
    """authOptions.mode token (KubeRay >= 1.5.1, Ray >= 2.52): the operator puts
    RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, from the named Secret's key auth_token, in
    every Ray container (SetContainerTokenAuthEnvVars, common/pod.go). It adds them only
    where they are missing (EnvVarExists), so no container may set them itself."""
    for path in MANIFESTS:
        cluster = _cluster(_manifest(path))
        assert cluster["authOptions"]["mode"] == "token"
        assert cluster["authOptions"]["secretName"]  # one known token, not one per cluster
        assert not cluster["authOptions"].get("enableK8sTokenAuth")
        assert validate_auth_options(cluster) == []
        for group in _groups(cluster):
            for variable in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
                assert _env(_containers(group)[0], variable) is None
    # Ray 2.60 knows the mode the operator sets (ray/_private/authentication/).
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR

    assert AUTH_MODE_ENV_VAR == "RAY_AUTH_MODE"


# KubeRay's key for the token in the Secret that authOptions.secretName names
# (RAY_AUTH_TOKEN_SECRET_KEY, ray-operator/controllers/ray/utils/constant.go).
RAY_AUTH_TOKEN_SECRET_KEY = "auth_token"


def _secrets_read(manifest: dict[str, Any]) -> set[tuple[str, str]]:
    cluster = _cluster(manifest)
    found = {(cluster["authOptions"]["secretName"], RAY_AUTH_TOKEN_SECRET_KEY)}
    for group in _groups(cluster):
        for container in _containers(group):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    found.add((ref["name"], ref["key"]))
    return found


def _secrets_the_guide_creates() -> set[tuple[str, str]]:
    """(Secret, key) of each `kubectl create secret generic NAME --from-literal=KEY=...`
    in docs/KUBERNETES.md, continuation lines joined."""
    created = set()
    for line in GUIDE.read_text().replace("\\\n", " ").splitlines():
        command = re.search(r"kubectl create secret generic (\S+)(.*)", line)
        if command:
            for key in re.findall(r"--from-literal=([-._A-Za-z0-9]+)=", command.group(2)):
                created.add((command.group(1), key))
    return created


def test_the_guide_creates_every_secret_the_manifests_read() -> None:
    """A Secret or key the guide does not create would keep the pods that read it from
    starting (CreateContainerConfigError): every one read is created there."""
    created = _secrets_the_guide_creates()
    read = set().union(*(_secrets_read(_manifest(path)) for path in MANIFESTS))
    credentials = next(
        e["authorization"]["credentials"]
        for e in _load(PODMONITOR)["spec"]["podMetricsEndpoints"]
        if "authorization" in e
    )
    read.add((credentials["name"], credentials["key"]))
    assert read - created == set(), f"read but not created by {GUIDE.name}"
    assert {"splitserve-hf-token", "splitserve-api-keys", "splitserve-ray-auth"} <= {
        name for name, _ in read
    }
    # The head holds no Secret of ours; Ray's token reaches it through authOptions.
    for path in MANIFESTS:
        head = _containers(_cluster(_manifest(path))["headGroupSpec"])[0]
        assert not any("valueFrom" in env for env in head.get("env", []))


@each_manifest
def test_hf_home_is_the_mounted_model_cache(path: Path) -> None:
    """Every pod that loads the model or its tokenizer downloads into HF_HOME, which is
    the mount of the shared claim (model-cache-pvc.yaml), so the model is downloaded once
    and a pod the autoscaler adds loads it from there."""
    claim = _load(MODEL_CACHE)
    assert (claim["apiVersion"], claim["kind"]) == ("v1", "PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # pods on several nodes at once
    for group in _cluster(_manifest(path))["workerGroupSpecs"]:
        container = _containers(group)[0]
        hf_home = _env(container, "HF_HOME")
        assert hf_home is not None, f"{group['groupName']} has no HF_HOME"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        volume = volumes[mounts[hf_home["value"]]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert not volume["persistentVolumeClaim"].get("readOnly")  # the first pod writes


# --- Prometheus ------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


@each_manifest
def test_the_podmonitor_scrapes_what_the_dashboard_reads(path: Path) -> None:
    """The same jobs, names and renames as dashboards/prometheus.yml, so the dashboard
    (dashboards/splitserve.json) works unchanged on Kubernetes."""
    monitor = _load(PODMONITOR)
    manifest = _manifest(path)
    groups = _groups(_cluster(manifest))
    selector = monitor["spec"]["selector"]["matchLabels"]
    for group in groups:
        assert selector.items() <= group["template"]["metadata"]["labels"].items()

    def job_of(endpoint: dict[str, Any]) -> str:
        (rule,) = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
        return rule["replacement"]

    endpoints = {job_of(e): e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {RAY_JOB, ROUTER_JOB}
    jobs = {job["job_name"]: job for job in _load(PROMETHEUS_CONFIG)["scrape_configs"]}
    expected = [
        {_camel(k): v for k, v in rule.items()} for rule in jobs[RAY_JOB]["metric_relabel_configs"]
    ]
    assert endpoints[RAY_JOB]["metricRelabelings"] == expected

    # Ray's metrics port on every pod; the router's /metrics on the router's own port
    # (test_the_podmonitor_scrapes_each_router_once_on_its_own_port).
    ray, router = endpoints[RAY_JOB], endpoints[ROUTER_JOB]
    for group in groups:
        container = _containers(group)[0]
        assert _port(container, ray["port"]) == int(group["rayStartParams"]["metrics-export-port"])
    assert router["path"] == jobs[ROUTER_JOB]["metrics_path"]
    assert not any(r.get("action") == "keep" for r in ray["relabelings"])


# --- The image -------------------------------------------------------------------------


def _pins() -> dict[str, str]:
    """Ray's version and Python's minor version (as the image tags write it) from
    pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (ray,) = [d for d in project["dependencies"] if d.startswith("ray[")]
    python = re.fullmatch(r">=3\.(\d+),<3\.\d+", project["requires-python"])
    assert python, project["requires-python"]
    return {"ray": ray.split("==")[1], "python": f"py3{python.group(1)}"}


def _instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (keyword, arguments), continuations joined."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, arguments = pending.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    return instructions


def test_the_base_image_matches_the_pins() -> None:
    pins = _pins()
    (base,) = [args for keyword, args in _instructions() if keyword == "FROM"]
    assert base == f"rayproject/ray:{pins['ray']}-{pins['python']}-gpu"


def _vllm_pin(requirements: list[str], extra: str) -> str:
    """The version ``vllm`` is pinned to (==) among requirements of one extra."""
    (pin,) = [
        r
        for r in requirements
        if re.match(r"vllm(\[[^]]*\])?\s*==", r) and f'extra == "{extra}"' in r
    ]
    return re.search(r"==\s*([^;,\s]+)", pin).group(1)  # type: ignore[union-attr]


def test_ray_llm_would_not_carry_our_vllm() -> None:
    """rayproject/ray-llm is Ray with ray[llm] and the vLLM that ray[llm] pins. While
    that pin differs from pyproject.toml's, its image would bring a vLLM the Dockerfile
    replaces, so the base stays rayproject/ray (docs/KUBERNETES.md, "The base image").
    When a Ray release pins our vLLM, this fails: reconsider ray-llm then."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (ours,) = project["optional-dependencies"]["gpu"]
    ours_version = ours.split("==")[1]
    ray_llm_version = _vllm_pin(importlib.metadata.requires("ray") or [], "llm")
    assert ray_llm_version != ours_version, "ray[llm] pins our vLLM now: consider ray-llm"
    (base,) = [args for keyword, args in _instructions() if keyword == "FROM"]
    assert not base.startswith("rayproject/ray-llm:")
    assert f"vllm=={ray_llm_version}" in DOCKERFILE.read_text(), "the Dockerfile says why"


def test_dependencies_are_installed_before_the_sources_are_copied() -> None:
    """A change to the sources must not invalidate the layer that installs vLLM."""
    steps = _instructions()
    copies = [(i, args.split()) for i, (keyword, args) in enumerate(steps) if keyword == "COPY"]
    (manifest_copy, manifest_args), (source_copy, source_args) = copies
    assert [a for a in manifest_args if not a.startswith("--")][:-1] == ["pyproject.toml"]
    assert [a for a in source_args if not a.startswith("--")][:-1] == ["."]
    installs = [
        i for i, (keyword, args) in enumerate(steps) if keyword == "RUN" and "pip install" in args
    ]
    dependencies, project = installs
    assert manifest_copy < dependencies < source_copy < project
    assert "--no-deps" in steps[project][1], "the project's own install adds no dependency"


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """.dockerignore as Docker reads it: (is an exception, pattern), in order."""
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        # moby's patternmatcher: ** crosses folders, * and ? stay within one.
        regex = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(
                part, re.escape(part)
            )
        patterns.append((exception, re.compile(regex)))
    return patterns


def _excluded(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """A path is excluded when the last pattern that matches it, or a folder above it,
    is not an exception (the pattern matcher of Docker's build context)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for exception, regex in patterns:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not exception
    return excluded


def _context_files() -> Iterator[tuple[str, int]]:
    patterns = _dockerignore()
    can_prune = not any(exception for exception, _ in patterns)
    for folder, dirnames, filenames in os.walk(REPO):
        relative = Path(folder).relative_to(REPO).as_posix()
        prefix = "" if relative == "." else relative + "/"
        if can_prune:
            dirnames[:] = [d for d in dirnames if not _excluded(prefix + d, patterns)]
        for name in filenames:
            if not _excluded(prefix + name, patterns):
                yield prefix + name, os.lstat(os.path.join(folder, name)).st_size


def test_the_build_context_is_small_and_holds_what_the_image_needs() -> None:
    files = dict(_context_files())
    total = sum(files.values())
    largest = sorted(files.items(), key=lambda item: -item[1])[:5]
    assert total < MAX_CONTEXT_BYTES, f"{total / 2**20:.1f} MiB; largest: {largest}"
    assert {"pyproject.toml", "README.md", "deployments/app.py"} <= files.keys()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert f"{package}/__init__.py" in files, f"the image would lack the {package} package"
    for path in files:
        assert not fnmatch.fnmatch(path, "*__pycache__*"), path
        assert not path.startswith((".git/", ".venv/", "results/")), path


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        (".venv/lib/python3.11/site-packages/ray/__init__.py", True),
        (".git/HEAD", True),
        ("router/__pycache__/ingress.cpython-311.pyc", True),
        ("splitserve.egg-info/PKG-INFO", True),
        ("results/loadgen/run-1/RUN.json", True),
        ("deployments/advised-pd.yaml", True),
        ("deployments/pd.yaml", False),
        ("router/http/ingress.py", False),
        ("pyproject.toml", False),
    ],
)
def test_the_dockerignore_matcher(path: str, excluded: bool) -> None:
    assert _excluded(path, _dockerignore()) is excluded
