"""What does our serving stack cost over bare vLLM? (benchmark, not a test)

The same workload (random 512-token prompts, 64 output tokens with ignore_eos, Poisson
4 req/s, 100 requests), driven by vLLM's own benchmark client, against:
  (a) the bare vLLM OpenAI server (python -m vllm.entrypoints.openai.api_server),
  (b) our deployments/single.yaml as `python -m deployments.serve single` serves it:
      Serve's direct ingress (the router replica listens on 8000 itself) and the engine
      in the router's process,
  (c) ray.serve.llm's build_openai_app,
  (d) the same YAML through a plain `serve run` (Serve's proxy in front of the router),
  (e) (b) with the engine in its own replica (router.engine_in_router: false), to size
      the router-to-engine hop (docs/DECISIONS.md),
  (f) (c) under (b)'s settings: the 2 real CPUs, direct ingress, replicas on their main
      loop, a fractional placement group, and Ray Serve LLM's direct streaming (its LLM
      server as the ingress); (g) the same with its stream batching off.
Prints TTFT and ITL p50/p99 with ratios to (a) and saves JSON, with the share of a
core each serving process used during the run (where the time goes). The bare server
and the client run at Ray's worker niceness (15), as the serving processes of (b) and
(c) do.

    python bench/overhead.py [--only a,b,d] [--num-prompts 100] [--out results/overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
import yaml
from rich.console import Console
from rich.table import Table

from deployments.app import SERVE_REPLICA_ENV
from deployments.launcher import (
    RAY_WORKER_NICENESS,
    REPO_ROOT,
    cluster_env,
    niced_like_ray_workers,
    serve_run,
)
from engines.socket_folders import VLLM_IPC_ENV
from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path
from splitserve.processes import ChildSettings, http_ok, running_process

console = Console()
PORT_BARE = 8100
DTYPE = "float32"  # what deployments/single.yaml runs the embedded model in
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
TARGETS = {"b": {"ttft_p50": 1.25, "itl_p50": 1.10}}
# Unmeasured requests of the cell's shape before each client run. In peers.py the first
# run of the 2048-token cell was 3-5x slower than the next two on every server, bare
# vLLM's included (cause not found); whether these warm-ups remove that is not yet known.
CLIENT_WARMUP_REQUESTS = 2
# Serving processes whose CPU is reported, by how their command line starts.
PROCESS_ROLES = {
    "ray::ProxyActor": "serve proxy",
    "ray::ServeReplica:splitserve:Router": "router",
    "ray::ServeReplica:splitserve:engine-": "engine replica",
    "ray::ServeReplica:default:": "ray.serve.llm replica",
    "VLLM::EngineCore": "vllm engine core",
    f"{sys.executable} -m vllm.entrypoints.openai.api_server": "vllm api server",
    # bench/relay_capacity.py's peer row: vllm-router (it renames its process so) over
    # the load generator's fake servers.
    "vllm::router": "vllm-router",
    f"{sys.executable} -m loadgen fake-server": "fake server",
}


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds so far of each serving process, summed by role."""
    totals: dict[str, float] = {}
    for process in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline, times = process.info["cmdline"], process.info["cpu_times"]
        if cmdline is None or times is None:
            continue  # it ended meanwhile
        command = " ".join(cmdline)
        role = next((r for m, r in PROCESS_ROLES.items() if command.startswith(m)), None)
        if role is not None:
            totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def run_client(
    base_url: str,
    request_rate: float,
    num_prompts: int,
    input_len: int = 512,
    output_len: int = 64,
) -> dict[str, Any]:
    """vLLM's benchmark client, in-process; percentiles over every request's samples."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    client_args = parser.parse_args(
        [
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", EMBEDDED_MODEL_NAME, "--tokenizer", str(embedded_model_path()),
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--ignore-eos",
            "--request-rate", str(request_rate), "--num-prompts", str(num_prompts),
            "--seed", "0", "--disable-tqdm", "--save-detailed",
            "--num-warmups", str(CLIENT_WARMUP_REQUESTS),
        ]
    )  # fmt: skip
    cpu_before, started = cpu_seconds_by_role(), time.monotonic()
    result = main(client_args)
    wall_s, cpu_after = time.monotonic() - started, cpu_seconds_by_role()
    ttfts = np.array([t for t in result["ttfts"] if t]) * 1000
    itls = np.array([gap for gaps in result["itls"] for gap in gaps]) * 1000
    return {
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "request_throughput": result["request_throughput"],
        "ttft_p50_ms": float(np.percentile(ttfts, 50)),
        "ttft_p99_ms": float(np.percentile(ttfts, 99)),
        "itl_p50_ms": float(np.percentile(itls, 50)),
        "itl_p90_ms": float(np.percentile(itls, 90)),
        "itl_mean_ms": float(np.mean(itls)),
        "itl_p99_ms": float(np.percentile(itls, 99)),
        # Tokens each streamed event carried: 1.0 unless a relay joined deltas it lagged
        # behind (the client counts an ITL per event, after the first).
        "tokens_per_event": tokens_per_event(result),
        # Share of one core per process role while the client ran (client start included).
        "cpu_share": {
            role: round((seconds - cpu_before.get(role, 0.0)) / wall_s, 3)
            for role, seconds in sorted(cpu_after.items())
        },
    }


def tokens_per_event(result: dict[str, Any]) -> float:
    """Output tokens over streamed events, over the completed requests of one run."""
    done = [
        (tokens, len(gaps) + 1)
        for tokens, gaps, error in zip(
            result["output_lens"], result["itls"], result["errors"], strict=True
        )
        if tokens and not error
    ]
    return sum(tokens for tokens, _ in done) / max(1, sum(events for _, events in done))


@contextlib.contextmanager
def bare_vllm(
    port: int = PORT_BARE, env: dict[str, str] | None = None, name: str = "bare-vllm"
) -> Iterator[str]:
    """One bare vLLM OpenAI server; ``env`` adds to its environment (a core binding)."""
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(embedded_model_path()), "--served-model-name", EMBEDDED_MODEL_NAME,
        "--port", str(port), "--enforce-eager", "--max-model-len", "4096",
        "--dtype", DTYPE,
    ]  # fmt: skip
    # At the niceness of Ray's workers, like the serving processes of (b) and (c).
    base_url = f"http://127.0.0.1:{port}"
    with served(command, name, f"{base_url}/health", RAY_WORKER_NICENESS, env):
        yield base_url


# Ray Serve LLM's own fast path: the LLM server is the ingress, no OpenAiIngress hop.
# Serve then routes through HAProxy, which it starts itself (Debian's haproxy package).
# Both are read when Ray is imported and where the cluster starts, so they go into the
# environment of the process that does both.
RAY_LLM_DIRECT_STREAMING = {
    "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
}
RAY_LLM_REPLICA_PORTS = 8010  # and the three above it


@contextlib.contextmanager
def ray_serve_llm(like_ours: bool = False, batching_ms: float | None = None) -> Iterator[str]:
    command = [sys.executable, __file__, "--serve-ray-llm"]
    if like_ours:
        command.append("--like-ours")
    if batching_ms is not None:
        command += ["--stream-batching-ms", str(batching_ms)]
    if like_ours and shutil.which("haproxy") is None:
        raise SystemExit("case (f) needs haproxy on the PATH: apt-get install haproxy")
    env = RAY_LLM_DIRECT_STREAMING if like_ours else {}
    with served(command, "ray-serve-llm", "http://127.0.0.1:8000/v1/models", env=env):
        yield "http://127.0.0.1:8000"


def serve_ray_llm_forever(like_ours: bool, batching_ms: float | None) -> None:
    """Child process of cases (c), (f), (g): ray.serve.llm's OpenAI app, embedded model.

    ``like_ours``: (b)'s settings: a cluster of the real 2 CPUs with Serve's direct
    ingress, replicas on their main loop, and LLMServer's placement group asking for a
    tenth of a CPU instead of whole ones; and Ray Serve LLM's direct streaming (the LLM
    server itself is the ingress). ``batching_ms``: its stream batching interval
    (``experimental_configs.stream_batching_interval_ms``; its default is 50 ms).
    """
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    extra: dict[str, Any] = {}
    if like_ours:
        # Read where the cluster starts: here. Its LLM router and LLM server are both
        # ingress replicas, each on a port of the range; HAProxy, in the proxy's place,
        # listens on 8000 and forwards to them.
        os.environ.update(cluster_env(RAY_LLM_REPLICA_PORTS, 4))
        ray.init(num_cpus=2, include_dashboard=False)
        serve.start(http_options={"port": 8000})
        extra["placement_group_config"] = {"bundles": [{"CPU": 0.1}]}
    else:
        # LLMServer's placement groups ask for whole CPUs: give Ray more than the 2 cores.
        ray.init(num_cpus=8, include_dashboard=False)
    if batching_ms is not None:
        extra["experimental_configs"] = {"stream_batching_interval_ms": batching_ms}
    env = {**ENGINE_ENV, **(SERVE_REPLICA_ENV if like_ours else {})}
    config = LLMConfig(
        **extra,
        model_loading_config={
            "model_id": EMBEDDED_MODEL_NAME,
            "model_source": str(embedded_model_path()),
        },
        accelerator_config={"kind": "cpu"},
        engine_kwargs={"max_model_len": 4096, "enforce_eager": True, "dtype": DTYPE},
        runtime_env={"env_vars": env},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
    )
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    serve.shutdown()
    ray.shutdown()


def peer_tool(package: str, version: str, command: str) -> Path:
    """A peer's command-line tool from PyPI, in a virtualenv of its own under
    .splitserve-cache/ (created on first use), so its pins never touch ours."""
    venv = REPO_ROOT / ".splitserve-cache" / f"{package}-{version}"
    binary = venv / "bin" / command
    if not binary.exists():
        console.print(f"installing {package} {version} into {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q", f"{package}=={version}"]
        subprocess.run(pip, check=True)
    return binary


@contextlib.contextmanager
def served(
    command: list[str],
    name: str,
    ready_url: str,
    niceness: int = 0,
    env: dict[str, str] | None = None,
) -> Iterator[None]:
    """A server process for the length of a block, once ``ready_url`` answers 200; stopped
    with SIGINT, and anything it started (engines included) killed if it lingers."""
    log = Path(tempfile.gettempdir()) / f"splitserve-bench-{name}.log"
    # A bare vLLM's IPC sockets go with the block (engines/socket_folders.py says why).
    with (
        tempfile.TemporaryDirectory(prefix=f"splitserve-bench-{name}-") as sockets,
        running_process(
            command,
            log,
            lambda: http_ok(ready_url, timeout_s=5),
            what=name,
            ready_timeout_s=600,
            stop_timeout_s=120,
            cwd=REPO_ROOT,
            env=dict(os.environ, **ENGINE_ENV, **(env or {}), **{VLLM_IPC_ENV: sockets}),
            child=ChildSettings(niceness=niceness),
        ),
    ):
        time.sleep(2)  # let a freshly listening server finish its warm-up
        yield


SINGLE_YAML = REPO_ROOT / "deployments" / "single.yaml"


@contextlib.contextmanager
def serve_run_url(path: Path = SINGLE_YAML, direct_ingress: bool = True) -> Iterator[str]:
    with serve_run(str(path), direct_ingress=direct_ingress) as app:
        yield app.base_url


@contextlib.contextmanager
def engines_apart_url(path: Path = SINGLE_YAML) -> Iterator[str]:
    """The YAML with every engine in a Serve replica of its own (the engine transport)."""
    config = yaml.safe_load(path.read_text())
    args = config["applications"][0]["args"]
    args.setdefault("router", {})["engine_in_router"] = False
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{path.stem}-engines-apart.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        with serve_run_url(path) as url:
            yield url


CASES = {
    "a": ("bare vLLM OpenAI server", bare_vllm),
    "b": ("splitserve single.yaml (python -m deployments.serve)", lambda: serve_run_url()),
    "c": ("ray.serve.llm build_openai_app", ray_serve_llm),
    "d": (
        "splitserve single.yaml, plain serve run (Serve's proxy)",
        lambda: serve_run_url(direct_ingress=False),
    ),
    "e": ("(b) with the engine in its own replica", lambda: engines_apart_url()),
    "f": ("(c) under (b)'s settings", lambda: ray_serve_llm(like_ours=True)),
    "g": (
        "(f) with stream batching off (0 ms)",
        lambda: ray_serve_llm(like_ours=True, batching_ms=0),
    ),
}


def print_table(results: dict[str, dict[str, Any]]) -> None:
    table = Table(title="Serving overhead: 512 in / 64 out, Poisson 4 req/s")
    for column in ("case", "req/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "vs (a)"):
        table.add_column(column, justify="right" if column != "case" else "left")
    base = results.get("a")
    for key, row in results.items():
        ratio = ""
        if base and key != "a":
            ratio = (
                f"TTFT {row['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x"
                f" / ITL {row['itl_p50_ms'] / base['itl_p50_ms']:.2f}x"
            )
        table.add_row(
            f"({key}) {CASES[key][0]}",
            f"{row['request_throughput']:.2f}",
            f"{row['ttft_p50_ms']:.1f} ms",
            f"{row['ttft_p99_ms']:.1f} ms",
            f"{row['itl_p50_ms']:.2f} ms",
            f"{row['itl_p99_ms']:.2f} ms",
            ratio,
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--only", default="a,b,c", help="cases to run, e.g. a,b")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "overhead.json")
    parser.add_argument("--serve-ray-llm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--like-ours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stream-batching-ms", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_ray_llm:
        serve_ray_llm_forever(args.like_ours, args.stream_batching_ms)
        return
    results: dict[str, dict[str, Any]] = {}
    for key in args.only.split(","):
        title, server = CASES[key]
        console.print(f"[bold]({key}) {title}[/]: starting")
        with server() as base_url, niced_like_ray_workers():
            results[key] = run_client(base_url, args.request_rate, args.num_prompts)
        console.print(f"({key}) done: {results[key]}")
    print_table(results)
    for key, row in results.items():
        shares = ", ".join(f"{role} {share:.2f}" for role, share in row["cpu_share"].items())
        console.print(f"({key}) cores used: {shares}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"workload": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
    )
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
