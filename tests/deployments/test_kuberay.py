"""The Kubernetes deployment (deployments/kuberay/) is one the cluster accepts as it stands.

- The RayService and the PodMonitor fit their CRDs' schemas (vendored, trimmed, in
  tests/data/kuberay/, with where they came from), and use no field the schema lacks:
  the API server drops or refuses those, so a misplaced field would vanish silently.
- The KubeRay operator's own rules that a schema cannot say hold; each check names the
  Go function of ray-operator/controllers/ray/ it mirrors (KubeRay master after
  v1.6.0-rc.0; the labels rule since v1.5).
- The embedded Serve config is a valid splitserve application whose pools find the Ray
  node labels they are placed on, and every pod can become Ready with it.
- The image builds in layers from a small context: dependencies before sources, base
  image matching pyproject.toml's pins, .dockerignore leaving out what a checkout grows.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.prometheus import RAY_JOB, ROUTER_JOB
from deployments.config import parse_app_config, refuse_engine_overrides

REPO = Path(__file__).resolve().parents[2]
KUBERAY = REPO / "deployments" / "kuberay"
MANIFEST = KUBERAY / "rayservice-pd.yaml"
SECRET = KUBERAY / "hf-token-secret.yaml"
PODMONITOR = KUBERAY / "podmonitor.yaml"
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


def _manifest() -> dict[str, Any]:
    return _load(MANIFEST)


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


def test_the_rayservice_fits_the_crd_schema() -> None:
    manifest = _manifest()
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
    ],
    ids=["unknown-field", "trimmed-field", "wrong-type", "missing-required"],
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


def validate_raycluster_spec(spec: dict[str, Any], annotations: dict[str, str]) -> list[str]:
    """ValidateRayClusterSpec, the rules a RayService's rayClusterConfig can break."""
    head = spec["headGroupSpec"]
    if not _containers(head):
        return ["headGroupSpec should have at least one container"]
    errors = validate_ray_group_resources("Head", head) + validate_ray_group_labels("Head", head)
    for group in spec.get("workerGroupSpecs", []):
        if not _containers(group):
            errors.append("workerGroupSpec should have at least one container")
            continue
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
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    if not autoscaling and head_env.get("RAY_enable_autoscaler_v2") in ("1", "true"):
        errors.append(
            "RAY_enable_autoscaler_v2 cannot be set when enableInTreeAutoscaling is false"
        )
    if spec.get("authOptions", {}).get("mode") == "token":
        version = tuple(int(part) for part in spec.get("rayVersion", "0").split(".")[:3])
        if version < (2, 52, 0):
            errors.append("authOptions.mode is 'token': Ray 2.52.0 or later is required")
    return errors


def validate_rayservice_spec(rayservice: dict[str, Any]) -> list[str]:
    """ValidateRayServiceSpec (which runs ValidateRayClusterSpec first)."""
    spec = rayservice["spec"]
    cluster = spec["rayClusterConfig"]
    errors = validate_raycluster_spec(cluster, rayservice["metadata"].get("annotations", {}))
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


def test_the_operator_accepts_the_rayservice() -> None:
    manifest = _manifest()
    assert validate_rayservice_metadata(manifest["metadata"]) == []
    assert validate_rayservice_spec(manifest) == []


def test_ray_node_labels_are_in_the_field_kuberay_reads_them_from() -> None:
    """validateRayGroupLabels refuses rayStartParams['labels'] since KubeRay 1.5: the
    labels belong in each group's top-level `labels`, which KubeRay passes to ray start."""
    manifest = _manifest()
    for group in _groups(manifest["spec"]["rayClusterConfig"]):
        assert "labels" not in group["rayStartParams"]
        assert group["labels"], "each group carries the label its pool is placed on"
    # The form KubeRay refuses, as the earlier manifest had it, is caught here.
    refused = _manifest()
    head = refused["spec"]["rayClusterConfig"]["headGroupSpec"]
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


def test_the_serve_config_survives_the_operators_yaml_to_json() -> None:
    """updateServeDeployment (rayservice_controller.go) unmarshals serveConfigV2 as YAML
    into a map and sends it to Ray's dashboard as JSON: keys must be strings throughout."""

    def string_keys(value: Any) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and string_keys(v) for k, v in value.items())
        if isinstance(value, list):
            return all(string_keys(item) for item in value)
        return True

    serve_config = _serve_config(_manifest())
    assert isinstance(serve_config, dict) and string_keys(serve_config)
    json.dumps(serve_config)


def test_the_upgrade_strategy_is_chosen_not_defaulted() -> None:
    """None: cluster changes wait for a restart instead of a second cluster's GPUs.

    The default, NewCluster, starts a whole second cluster (as many GPUs again) for any
    change to rayClusterConfig; the incremental strategy needs the autoscaler and a
    Gateway. serveConfigV2 changes are applied in place under every strategy.
    """
    spec = _manifest()["spec"]
    assert spec["upgradeStrategy"] == {"type": "None"}


# --- The application and the cluster it runs on ---------------------------------------


def test_it_is_a_rayservice_for_our_ray_version() -> None:
    manifest = _manifest()
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == _pins()["ray"]


def test_the_embedded_application_is_valid(tmp_path: Path) -> None:
    serve_config = _serve_config(_manifest())
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
    application = _serve_config(manifest)["applications"][0]
    config = parse_app_config(application["args"])
    groups = _groups(manifest["spec"]["rayClusterConfig"])
    for pool in config.pools:
        assert pool.placement is not None
        wanted = pool.placement.node_labels
        matching = [g for g in groups if wanted.items() <= g.get("labels", {}).items()]
        assert matching, f"no node group carries {wanted} for the {pool.role} pool"
        for group in matching:
            (container,) = _containers(group)
            gpus = int(container["resources"]["limits"][GPU])
            assert gpus >= pool.ranks_per_replica * pool.replicas
    images = {_containers(g)[0]["image"] for g in groups}
    assert len(images) == 1, "every node runs the same splitserve image"


def test_every_pod_can_become_ready() -> None:
    """initLivenessAndReadinessProbe (common/pod.go) gives every RayService worker a
    readiness probe on Serve's proxy, at the container port named serve (8000 if none).
    HeadOnly leaves workers without a proxy, never Ready; EveryNode starts one on every
    node hosting a replica, so each worker group must host one of the pools."""
    manifest = _manifest()
    serve_config = _serve_config(manifest)
    assert serve_config["proxy_location"] == "EveryNode"
    port = serve_config["http_options"]["port"]
    args = serve_config["applications"][0]["args"]
    placed = [p["placement"]["node_labels"] for p in args["pools"]]
    cluster = manifest["spec"]["rayClusterConfig"]
    for group in cluster["workerGroupSpecs"]:
        assert any(labels.items() <= group["labels"].items() for labels in placed), (
            f"worker group {group['groupName']} hosts no replica, so no proxy: never Ready"
        )
        assert (_port(_containers(group)[0], "serve") or 8000) == port
    # BuildServeService (common/service.go) points the serve service at the head
    # container's port named serve.
    assert _port(_containers(cluster["headGroupSpec"])[0], "serve") == port


def test_the_hugging_face_token_comes_from_the_secret() -> None:
    secret = _load(SECRET)
    assert (secret["apiVersion"], secret["kind"]) == ("v1", "Secret")
    (key,) = secret["stringData"]
    placeholder = secret["stringData"][key]
    assert not placeholder.startswith("hf_"), "the template must not hold a real token"
    for group in _groups(_manifest()["spec"]["rayClusterConfig"]):
        for container in _containers(group):
            (env,) = [e for e in container.get("env", []) if e["name"] == "HF_TOKEN"]
            assert "value" not in env
            assert env["valueFrom"]["secretKeyRef"] == {
                "name": secret["metadata"]["name"],
                "key": key,
            }
    assert _excluded(SECRET.relative_to(REPO).as_posix(), _dockerignore())


# --- Prometheus ------------------------------------------------------------------------


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def test_the_podmonitor_scrapes_what_the_dashboard_reads() -> None:
    """The same jobs, names and renames as dashboards/prometheus.yml, so the dashboard
    (dashboards/splitserve.json) works unchanged on Kubernetes."""
    monitor = _load(PODMONITOR)
    manifest = _manifest()
    groups = _groups(manifest["spec"]["rayClusterConfig"])
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

    # Ray's metrics port on every pod; the router's /metrics through the head's proxy only
    # (each proxy reaches the same router: scraping every pod would count it per pod).
    ray, router = endpoints[RAY_JOB], endpoints[ROUTER_JOB]
    for group in groups:
        container = _containers(group)[0]
        assert _port(container, ray["port"]) == int(group["rayStartParams"]["metrics-export-port"])
    head = _containers(manifest["spec"]["rayClusterConfig"]["headGroupSpec"])[0]
    assert _port(head, router["port"]) == _serve_config(manifest)["http_options"]["port"]
    keep = [r for r in router["relabelings"] if r.get("action") == "keep"]
    assert keep == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"],
            "regex": "head",
            "action": "keep",
        }
    ]
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
