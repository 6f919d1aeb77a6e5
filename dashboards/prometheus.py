"""``python -m dashboards.prometheus``: a real Prometheus beside a running splitserve cluster.

Installs Debian's ``prometheus`` package with apt-get if it is missing, points
dashboards/prometheus.yml at the cluster (router address, the Ray cluster's own
service-discovery file, the load generator's metrics port) with the alert rules of
dashboards/alerts.yml, starts Prometheus on it,
waits until it is ready and every target has been scraped once, and prints where to
point Grafana. Ctrl-C stops it. The tests use ``run_prometheus`` the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from splitserve.processes import LaunchError, http_ok, running_process

DASHBOARDS_DIR = Path(__file__).resolve().parent
CONFIG_TEMPLATE = DASHBOARDS_DIR / "prometheus.yml"
PROVISIONING_DIR = DASHBOARDS_DIR / "provisioning"
APT_PACKAGE = "prometheus"  # Debian's package: the prometheus and promtool binaries
DEFAULT_PORT = 9090
DEFAULT_RAY_TEMP_DIR = Path("/tmp/ray")  # Ray's default --temp-dir
READY_TIMEOUT_S = 60.0
POLL_S = 0.5
STOP_TIMEOUT_S = 15.0
ROUTER_JOB, RAY_JOB, LOADGEN_JOB = "splitserve-router", "ray", "loadgen"


class PrometheusError(RuntimeError):
    """Prometheus could not be installed, configured or started."""


@dataclass(frozen=True)
class ScrapeTargets:
    """What to scrape; None keeps what dashboards/prometheus.yml says."""

    router: str | None = None  # host:port of the Serve proxy (the router's /metrics)
    ray_discovery_file: Path | None = None  # the Ray cluster's prom_metrics_service_discovery
    loadgen: str | None = None  # host:port of `python -m loadgen --metrics-port`
    scrape_interval: str | None = None  # e.g. "1s" for tests
    # Ray's per-node endpoints keep every counter and histogram of every process the
    # cluster ever ran, so a long-lived cluster's page takes seconds to render on a busy
    # node: these may need a longer interval, and the same timeout (a job's timeout is
    # otherwise the global one, which a short global interval caps).
    ray_scrape_interval: str | None = None


@dataclass(frozen=True)
class RunningPrometheus:
    url: str
    config_path: Path
    data_dir: Path
    process: subprocess.Popen[bytes]


def ensure_prometheus(install: bool = True) -> tuple[str, str]:
    """Paths of ``prometheus`` and ``promtool``, installing Debian's package if missing."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if all(found):
        return found  # type: ignore[return-value]
    if not install:
        raise PrometheusError("prometheus is not installed (apt-get install prometheus)")
    apt = shutil.which("apt-get")
    if apt is None:
        raise PrometheusError("prometheus is missing and this is not a Debian system")
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"installing Debian's {APT_PACKAGE} package with apt-get ...", file=sys.stderr)
    for command in (
        [*prefix, apt, "update", "-q"],
        [*prefix, apt, "install", "-y", "-q", "--no-install-recommends", APT_PACKAGE],
    ):
        if subprocess.run(command, env=env).returncode != 0:
            raise PrometheusError(f"failed: {' '.join(command)} (run it as root, then retry)")
    found = shutil.which("prometheus"), shutil.which("promtool")
    if not all(found):
        raise PrometheusError(f"apt-get installed {APT_PACKAGE} but no prometheus on PATH")
    return found  # type: ignore[return-value]


def ray_discovery_file(ray_address: str, temp_dir: Path = DEFAULT_RAY_TEMP_DIR) -> Path:
    """The service-discovery file of this Ray cluster (not the latest one on the machine).

    Ray keeps ``<temp_dir>/<session>/prom_metrics_service_discovery.json`` current as
    nodes join; the ``<temp_dir>`` copy is a symlink to whichever cluster started last.
    """
    from ray._private import ray_constants
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # Cython, no stub

    session = GcsClient(address=ray_address).internal_kv_get(
        b"session_name", ray_constants.KV_NAMESPACE_SESSION
    )
    if not session:
        raise PrometheusError(f"no Ray session found at {ray_address}")
    return temp_dir / session.decode() / ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def render_config(targets: ScrapeTargets, template: Path = CONFIG_TEMPLATE) -> dict[str, Any]:
    """dashboards/prometheus.yml with the given targets put in."""
    config = yaml.safe_load(template.read_text())
    if targets.scrape_interval:
        config["global"]["scrape_interval"] = targets.scrape_interval
        config["global"]["evaluation_interval"] = targets.scrape_interval
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    if targets.router:
        jobs[ROUTER_JOB]["static_configs"] = [{"targets": [targets.router]}]
    if targets.loadgen:
        jobs[LOADGEN_JOB]["static_configs"] = [{"targets": [targets.loadgen]}]
    if targets.ray_discovery_file:
        jobs[RAY_JOB]["file_sd_configs"] = [{"files": [str(targets.ray_discovery_file)]}]
    if targets.ray_scrape_interval:
        jobs[RAY_JOB]["scrape_interval"] = targets.ray_scrape_interval
        jobs[RAY_JOB]["scrape_timeout"] = targets.ray_scrape_interval
    # Prometheus reads rule files relative to the config, which is written elsewhere.
    config["rule_files"] = [str(template.parent / path) for path in config.get("rule_files", [])]
    return config


@contextlib.contextmanager
def run_prometheus(
    targets: ScrapeTargets,
    *,
    port: int = DEFAULT_PORT,
    host: str = "127.0.0.1",
    work_dir: Path | None = None,
    install: bool = True,
) -> Iterator[RunningPrometheus]:
    """Prometheus on ``host:port`` with the rendered config, until the block ends."""
    prometheus, promtool = ensure_prometheus(install)
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="splitserve-prometheus-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(render_config(targets), sort_keys=False))
    check = subprocess.run(
        [promtool, "check", "config", str(config_path)], capture_output=True, text=True
    )
    if check.returncode != 0:
        raise PrometheusError(f"promtool rejected {config_path}:\n{check.stdout}{check.stderr}")
    data_dir = work_dir / "data"
    log_path = work_dir / "prometheus.log"
    command = [
        prometheus,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={host}:{port}",
    ]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with running_process(
            command,
            log_path,
            lambda: http_ok(f"{url}/-/ready", timeout_s=2),
            what="prometheus",
            ready_timeout_s=READY_TIMEOUT_S,
            stop_timeout_s=STOP_TIMEOUT_S,
            stop_signal=signal.SIGTERM,
        ) as process:
            yield RunningPrometheus(url, config_path, data_dir, process)
    except LaunchError as error:
        raise PrometheusError(str(error)) from None


def target_health(url: str) -> list[dict[str, str]]:
    """Every active target's job, address, health and last error."""
    response = httpx.get(f"{url}/api/v1/targets", params={"state": "active"}, timeout=5)
    response.raise_for_status()
    return [
        {
            "job": target["labels"].get("job", target.get("scrapePool", "")),
            "address": target["labels"].get("instance", ""),
            "health": target["health"],
            "error": target.get("lastError", ""),
            "scrape_s": f"{target.get('lastScrapeDuration', 0):.3f}",
        }
        for target in response.json()["data"]["activeTargets"]
    ]


def wait_first_scrapes(url: str, timeout_s: float) -> list[dict[str, str]]:
    """Targets once none is still 'unknown' (never scraped), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    targets = target_health(url)
    # Discovery fills the list a moment after start; a new target reads 'unknown'.
    while (not targets or any(t["health"] == "unknown" for t in targets)) and (
        time.monotonic() < deadline
    ):
        time.sleep(POLL_S)
        targets = target_health(url)
    return targets


def grafana_instructions(url: str) -> str:
    return "\n".join(
        (
            f"Grafana: add a Prometheus datasource at {url} and import"
            f" {DASHBOARDS_DIR / 'splitserve.json'},",
            "  or let Grafana provision both:",
            f"  GF_PATHS_PROVISIONING={PROVISIONING_DIR} SPLITSERVE_PROMETHEUS_URL={url}"
            f" SPLITSERVE_DASHBOARDS_DIR={DASHBOARDS_DIR} grafana server",
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dashboards.prometheus",
        description="Start Prometheus (Debian's package, installed if missing) with"
        " dashboards/prometheus.yml beside a running splitserve cluster.",
    )
    parser.add_argument("--router", default="127.0.0.1:8000", help="host:port of serve run")
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS"),
        help="GCS address host:port of the Ray cluster to scrape (default: $RAY_ADDRESS;"
        " without one, the cluster that started last on this machine)",
    )
    parser.add_argument("--ray-temp-dir", type=Path, default=DEFAULT_RAY_TEMP_DIR)
    parser.add_argument("--loadgen", default="127.0.0.1:9400", help="loadgen --metrics-port")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--host", default="0.0.0.0", help="listen address (Grafana elsewhere)")
    parser.add_argument("--scrape-interval", default=None, help="override, e.g. 1s")
    parser.add_argument("--work-dir", type=Path, default=None, help="config and data folder")
    parser.add_argument("--no-install", action="store_true", help="fail instead of apt-get")
    parser.add_argument(
        "--install-only", action="store_true", help="install Prometheus if missing, then exit"
    )
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too must stop Prometheus, not orphan it


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.install_only:
        print(" ".join(ensure_prometheus(install=True)))
        return 0
    discovery = None
    if args.ray_address and args.ray_address != "auto":
        discovery = ray_discovery_file(args.ray_address, args.ray_temp_dir)
    targets = ScrapeTargets(args.router, discovery, args.loadgen, args.scrape_interval)
    try:
        with run_prometheus(
            targets,
            port=args.port,
            host=args.host,
            work_dir=args.work_dir,
            install=not args.no_install,
        ) as running:
            print(f"Prometheus: {running.url} (config {running.config_path})")
            for target in wait_first_scrapes(running.url, timeout_s=READY_TIMEOUT_S):
                note = f" ({target['error']})" if target["error"] else ""
                print(f"  {target['job']:<18} {target['address']:<24} {target['health']}{note}")
            print(grafana_instructions(running.url))
            print("Ctrl-C stops Prometheus.")
            running.process.wait()
    except PrometheusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
