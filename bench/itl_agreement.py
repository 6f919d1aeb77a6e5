"""Whose inter-token latency is right? Three clients and the router's own view (benchmark).

One ``single.yaml`` server; one after another, the same workload (random 512 -> 64
tokens, ignore_eos, Poisson 4 req/s, 100 requests) from our load generator (``python -m
loadgen``), vLLM's benchmark client, and GuideLLM (from PyPI, in a virtualenv of its own
under ``.splitserve-cache/``). For each client's window, the router's own histogram of
the gaps between the chunks it wrote (``splitserve_inter_token_latency_seconds``, its
mean exact, its p50 interpolated within a bucket) is the reference. Every client runs
at Ray's worker niceness, as the server's processes do.

The clients differ in what they time: vLLM's client stamps each SSE event as it parses
it, so several events that arrive in one network read count as one long gap and
several near-zero ones; ours stamps each read and spreads its gap over the tokens it
carries. Means agree either way; medians need not.

    python bench/itl_agreement.py [--num-prompts 100] [--request-rate 4] [--repeats 1]
        [--out results/itl_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from client_agreement import histogram_snapshot, histogram_window
from overhead import peer_tool, run_client
from rich.console import Console
from rich.table import Table

from deployments.launcher import REPO_ROOT, niced_like_ray_workers, serve_run
from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path

console = Console(width=150)
GUIDELLM_VERSION = "0.8.1"
ITL_HISTOGRAM = "splitserve_inter_token_latency_seconds"


def guidellm_binary() -> Path:
    return peer_tool("guidellm", GUIDELLM_VERSION, "guidellm")


def server_itl(base_url: str) -> dict[str, Any]:
    """The router's ITL histogram now: cumulative bucket counts, sum, count."""
    return histogram_snapshot([httpx.get(f"{base_url}/metrics", timeout=10).text], ITL_HISTOGRAM)


def run_ours(base_url: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    command = [
        sys.executable, "-m", "loadgen", "--base-url", base_url, "--input-len", "512",
        "--output-len", "64", "--qps", str(args.request_rate), "--num-requests",
        str(args.num_prompts), "--warmup-requests", "0", "--no-progress", "--no-plots",
        "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=REPO_ROOT)
    (run,) = [p for p in out.glob("*.json") if not p.name.endswith(".vllm.json")]
    itl = json.loads(run.read_text())["summary"]["itl"]
    return {"itl_p50_ms": 1000 * itl["p50"], "itl_mean_ms": 1000 * itl["mean"]}


def run_vllm(base_url: str, args: argparse.Namespace) -> dict[str, float]:
    figures = run_client(base_url, args.request_rate, args.num_prompts, 512, 64)
    return {"itl_p50_ms": figures["itl_p50_ms"], "itl_mean_ms": figures["itl_mean_ms"]}


def run_guidellm(base_url: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    report_path = out / "guidellm.json"
    command = [
        str(guidellm_binary()), "run",
        "--backend", f"kind=openai_http,target={base_url},model={EMBEDDED_MODEL_NAME},"
        "request_format=/v1/completions",
        "--profile", f"kind=poisson,rate={args.request_rate}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--tokenizer", f"kind=huggingface_auto,model={embedded_model_path()}",
        "--data", "kind=synthetic_text,prompt_tokens=512,output_tokens=64",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm failed:\n{done.stderr[-2000:]}")
    itl = _find(json.loads(report_path.read_text()), "inter_token_latency_ms")
    successful = itl.get("successful", itl)
    return {"itl_p50_ms": successful["median"], "itl_mean_ms": successful["mean"]}


def _find(document: Any, key: str) -> Any:
    """The first value under ``key`` anywhere in a JSON document (GuideLLM nests its
    metrics under the benchmark, then the metric, then the request status)."""
    children: Iterable[Any]
    if isinstance(document, dict):
        if key in document:
            return document[key]
        children = document.values()
    elif isinstance(document, list):
        children = document
    else:
        return None
    for child in children:
        found = _find(child, key)
        if found is not None:
            return found
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--clients", default="loadgen,vllm,guidellm")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "itl_agreement.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with serve_run("single") as app, niced_like_ray_workers():
        for repeat in range(args.repeats):
            for client in args.clients.split(","):
                before = server_itl(app.base_url)
                with tempfile.TemporaryDirectory() as folder:
                    if client == "loadgen":
                        figures = run_ours(app.base_url, args, Path(folder))
                    elif client == "vllm":
                        figures = run_vllm(app.base_url, args)
                    else:
                        figures = run_guidellm(app.base_url, args, Path(folder))
                server = histogram_window(before, server_itl(app.base_url))
                rows.append({"client": client, "repeat": repeat, **figures,
                             "server_itl_p50_ms": server["p50_ms"],
                             "server_itl_mean_ms": server["mean_ms"]})  # fmt: skip
                console.print(rows[-1])
    table = Table(title="ITL as each client saw it, and the router in the same window")
    for column in ("client", "ITL p50", "router p50", "ratio", "ITL mean", "router mean", "ratio"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["client"],
            f"{row['itl_p50_ms']:.2f} ms", f"{row['server_itl_p50_ms']:.2f} ms",
            f"{row['itl_p50_ms'] / row['server_itl_p50_ms']:.2f}x",
            f"{row['itl_mean_ms']:.2f} ms", f"{row['server_itl_mean_ms']:.2f} ms",
            f"{row['itl_mean_ms'] / row['server_itl_mean_ms']:.2f}x",
        )  # fmt: skip
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
