"""How fast does KV move through Ray's object store? (benchmark, not a test)

Part (a), host path: the KV of one 2,048-token prompt in the Llama-3.2-1B layout
(16 layers x 8 KV heads x 64 head dim x K and V x fp16 = 32 KiB per token, 64 MiB)
moves between two Ray actors, each holding a paged KV cache with vLLM's CPU layout.
"put" is the prefill side (pack the request's pages + ray.put), "get" the decode side
(ray.get + write the pages into its own cache), both with the connector's own
PagedKVCache. Baseline: one np.copyto of the same 64 MiB inside one process. Measured
after a warm-up that has written the whole object store (``warmup_transfers``).

It also compares object granularities: one object per request per rank holding every
layer (what the connector does), the same through a staging buffer, and one object
per layer.

Part (b), end to end on the embedded model through the router (``serve run``): TTFT
and ITL of deployments/single.yaml and of PD with every prompt prefilled remotely
(deployments/pd_always.yaml; pd.yaml's conditional policy would also prefill these remotely
prompts, but "always" is the study's PD by construction), for 1,500-token prompts and
64 output tokens, sent one at a time (a sequential workload: no queueing, so TTFT is
the service time). The transfer's share of PD's TTFT comes from the connector's own
histogram ``splitserve_kv_transfer_seconds{op}`` scraped from the router's /metrics
before and after the measured requests: (mean put + mean get) / mean TTFT, a
conservative figure: neither is on the TTFT path any more. The put (prefill side)
runs on the worker's saver thread while the first token travels, and the registration
that follows it is not awaited. The get (decode side: fetching the part, pushed ahead
to the decode engine the router chose, and writing its pages) runs after t1 and mostly
before the decode request arrives; what is left of it lands in the first inter-token
gap, reported beside it with the loads by path (pushed or claimed).

Part (c): the same PD flow with vLLM's ExampleConnector (KV through safetensors files,
bench/pd_example_connector.yaml), timed into the same histogram by
kv_transfer.example_disk, against ours.

Parts (b) and (c) again with ``--model llama-3.2-1b-kv``: a tiny Llama with
Llama-3.2-1B's KV shape, where a request's KV weighs what it would on the study's model
(62.5 MiB for 1,000 tokens), not 1.5 MiB. ``--rounds N`` measures the cases in turn N
times; part (c)'s verdict takes the median of the per-round ratios.

Part (d), across nodes: part (a)'s transfer with the decode side on a second Ray node
of this machine (its own object store; Ray's object manager moves the bytes), against
both on one node: what the object-store path costs per MiB when it crosses machines.

    python bench/kv_transfer.py [--part a|b|c|d|all] [--out results/kv_transfer.json]
        a, d: [--tokens 2048] [--repeats 10]
        b, c: [--requests 30] [--prompt-tokens 1500] [--model embedded] [--rounds 1]
Parts b and c start Ray Serve apps on port 8000: run them under
``flock /tmp/splitserve-serving.lock``. Each run updates its parts in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray
import yaml
from ray.actor import ActorHandle
from rich.console import Console
from rich.table import Table

# Run as a script, this file's folder leads sys.path, and this file, named like the
# package it measures, would shadow that package (and `deployments`' import of it).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

from deployments.config import load_app_config  # noqa: E402
from deployments.launcher import cluster_env, serve_run  # noqa: E402
from engines.tiny_model import TinyLlamaSpec, embedded_model_path  # noqa: E402
from loadgen.client.server_view import parse_metrics  # noqa: E402
from loadgen.config import RunConfig, WorkloadConfig  # noqa: E402
from loadgen.scheduling.runner import execute_run  # noqa: E402
from splitserve import metric_catalogue as catalogue  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
console = Console()
GRANULARITIES = ("request", "request-staged", "layer")
PARTS = ("a", "b", "c", "d", "all")
TARGET_RATIO = 0.5
# Part (a)'s object store: room for a few transfers in flight, small enough that the
# warm-up below writes all of it (see warmup_transfers).
DEFAULT_OBJECT_STORE_MIB = 512


# Llama-3.2-1B's KV layout; 128 is vLLM's default block size on the CPU.
LLAMA_3_2_1B = {"layers": 16, "kv_heads": 8, "head_size": 64, "block_size": 128}
FP16_BYTES = 2


class KVEndpoint:
    """One side of a transfer: a paged KV cache in vLLM's CPU layout, fp16 (Ray runs it
    as the ``KVEndpointActor`` actor)."""

    def __init__(self, shape: dict[str, int], num_blocks: int, seed: int) -> None:
        import torch

        from kv_transfer.object_store.paged_cache import PagedKVCache

        generator = torch.Generator().manual_seed(seed)
        page = (shape["kv_heads"], shape["block_size"], 2 * shape["head_size"])
        caches = {
            f"layer.{i}": torch.randn((num_blocks, *page), generator=generator).half()
            for i in range(shape["layers"])
        }
        self._cache = PagedKVCache(caches, shape["block_size"])

    @ray.method
    def put(self, block_ids: list[int], granularity: str) -> tuple[list[ray.ObjectRef], float]:
        started = time.perf_counter()
        refs: list[ray.ObjectRef]
        if granularity == "request":
            refs = [ray.put(self._cache.pack(block_ids))]
        elif granularity == "request-staged":
            staged = np.stack([np.concatenate(runs) for runs in self._cache.pack(block_ids)])
            refs = [ray.put(staged)]
        else:
            refs = [ray.put(runs) for runs in self._cache.pack(block_ids)]
        return refs, time.perf_counter() - started

    @ray.method
    def get(self, refs: list[ray.ObjectRef], block_ids: list[int], granularity: str) -> float:
        started = time.perf_counter()
        if granularity == "request":
            self._cache.unpack(ray.get(refs[0]), 0, block_ids)
        elif granularity == "request-staged":
            staged = ray.get(refs[0])
            self._cache.unpack([[layer] for layer in staged], 0, block_ids)
        else:
            self._cache.unpack([ray.get(ref) for ref in refs], 0, block_ids)
        return time.perf_counter() - started

    @ray.method
    def checksum(self, block_ids: list[int]) -> float:
        packed = self._cache.pack(block_ids)
        return float(sum(run.astype(np.float64).sum() for runs in packed for run in runs))


KVEndpointActor = ray.remote(num_cpus=0)(KVEndpoint)


def numpy_copy_seconds(nbytes: int, repeats: int) -> list[float]:
    source = np.random.default_rng(0).standard_normal(nbytes // 2).astype(np.float16)
    destination = np.empty_like(source)
    np.copyto(destination, source)  # fault the pages in first
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(destination, source)
        samples.append(time.perf_counter() - started)
    return samples


def warmup_transfers(args: argparse.Namespace, nbytes: int) -> int:
    """Transfers to run before measuring: by default, enough to write the whole store.

    A process's first write to each page of the object store's shared memory takes a
    page fault (64 MiB: 16,384 faults, ~40 ms, against ~5 ms once mapped), so the first
    puts of a new process measure the kernel, not the path. A prefill worker lives
    for the engine's life and pays that once per page; the steady state is what a
    serving engine sees. docs/DECISIONS.md has both.
    """
    if args.warmup is not None:
        return args.warmup
    store = (args.object_store_mib or 0) * 2**20
    return -(-store // nbytes) + 3 if store else 3


def transfer_seconds(
    args: argparse.Namespace, granularity: str
) -> tuple[list[float], list[float], bool]:
    shape = {key: getattr(args, key) for key in LLAMA_3_2_1B}
    num_request_blocks = -(-args.tokens // args.block_size)
    num_blocks = 4 * num_request_blocks + 1
    rng = np.random.default_rng(1)
    # Scattered blocks, as in a cache that has served other requests (block 0 is vLLM's null).
    source_blocks, target_blocks = (
        [int(block) for block in rng.choice(np.arange(1, num_blocks), num_request_blocks, False)]
        for _ in range(2)
    )
    producer = KVEndpointActor.remote(shape, num_blocks, seed=1)
    consumer = KVEndpointActor.remote(shape, num_blocks, seed=2)
    puts, gets = [], []
    warmup = warmup_transfers(args, num_request_blocks * args.block_size * _token_bytes(args))
    for iteration in range(warmup + args.repeats):
        refs, put_s = ray.get(producer.put.remote(source_blocks, granularity))
        get_s = ray.get(consumer.get.remote(refs, target_blocks, granularity))
        del refs
        if iteration >= warmup:
            puts.append(put_s)
            gets.append(get_s)
    identical = ray.get(producer.checksum.remote(source_blocks)) == ray.get(
        consumer.checksum.remote(target_blocks)
    )
    for actor in (producer, consumer):
        # Ray types a new actor as its handle or its class (so that its methods type-check).
        assert isinstance(actor, ActorHandle)
        ray.kill(actor)
    return puts, gets, identical


def _token_bytes(args: argparse.Namespace) -> int:
    return args.layers * args.kv_heads * args.head_size * 2 * FP16_BYTES


def summarize(nbytes: int, samples: list[float]) -> dict[str, float]:
    median = statistics.median(samples)
    return {
        "median_ms": median * 1e3,
        "min_ms": min(samples) * 1e3,
        "gb_per_s": nbytes / median / 1e9,
    }


def print_tables(results: dict[str, Any]) -> None:
    copy = results["numpy_copy"]["gb_per_s"]
    mib = results["nbytes"] / 2**20
    table = Table(title=f"KV transfer, {mib:.0f} MiB ({results['tokens']} tokens)")
    for column in ("path", "granularity", "median ms", "min ms", "GB/s", "x numpy copy"):
        table.add_column(column, justify="right" if column != "path" else "left")
    table.add_row("numpy copy (1 process)", "-", *_cells(results["numpy_copy"], copy))
    for granularity, row in results["transfers"].items():
        for op in ("put", "get", "put+get"):
            table.add_row(op, granularity, *_cells(row[op], copy))
    console.print(table)
    request = results["transfers"].get("request")
    if request:
        worst = min(request["put"]["gb_per_s"], request["get"]["gb_per_s"]) / copy
        verdict = "meets" if worst >= TARGET_RATIO else "misses"
        console.print(
            f"granularity 'request': slower of put/get = {worst:.2f}x the copy, "
            f"{verdict} the {TARGET_RATIO}x target"
        )


def _cells(row: dict[str, float], copy_gb_per_s: float) -> tuple[str, ...]:
    ratio = row["gb_per_s"] / copy_gb_per_s
    return (
        f"{row['median_ms']:.1f}",
        f"{row['min_ms']:.1f}",
        f"{row['gb_per_s']:.2f}",
        f"{ratio:.2f}",
    )


# ---- parts (b) and (c): end to end through the router ------------------------------

PROMPT_TOKENS = 1500
# Enough inter-token gaps per request for a stable ITL; the decode stays small beside
# the 1,500-token prefill.
OUTPUT_TOKENS = 64
E2E_REQUESTS = 30
# The first requests of a fresh app pay one-off costs (allocations, first Ray calls).
E2E_WARMUPS = 3
WARMUP_SEED, MEASURED_SEED = 1, 0  # different seeds: warm-up prompts never prefix-hit
TARGET_SHARE = 0.10
# The router refreshes its copy of the transfer metrics every stats_interval_s (0.2 s).
METRICS_SETTLE_S = 1.0
# Logical CPUs of the bench's own Ray head: every deployment asks for a fraction of one.
HEAD_NUM_CPUS = 4
PD_ALWAYS = REPO_ROOT / "deployments" / "pd_always.yaml"
EXAMPLE_CONFIG = REPO_ROOT / "bench" / "pd_example_connector.yaml"
SINGLE = REPO_ROOT / "deployments" / "single.yaml"
E2E_CASES = {
    "single": ("single (1 engine)", SINGLE),
    # single.yaml bound to one core, as each PD engine is: PD vs single at equal cores
    # per engine (written from single.yaml at run time, so it cannot drift).
    "single-1core": ("single, 1 core", None),
    "pd": ("PD, ours", PD_ALWAYS),
    "pd-example": ("PD, ExampleConnector", EXAMPLE_CONFIG),
}
# Wide enough for the end-to-end table in a log file, where rich assumes 80 columns.
E2E_TABLE_WIDTH = 130
CASES_OF_PART = {
    "b": ("single", "single-1core", "pd"),
    "c": ("pd", "pd-example"),
    "all": ("single", "single-1core", "pd", "pd-example"),
}
ONE_CORE_BIND = "0"
# The embedded model moves 1 KiB of KV per token (1.5 MiB for a 1,500-token prompt):
# too little for either connector's copying to show beside its fixed costs. The other
# model is as tiny, but with Llama-3.2-1B's KV shape (16 layers x 8 KV heads x 64 head
# dim), in fp32 like the embedded one: 64 KiB per token, 64 MiB for 1,024 tokens.
DEFAULT_MODEL = "embedded"
MODELS: dict[str, TinyLlamaSpec | None] = {
    DEFAULT_MODEL: None,
    "llama-3.2-1b-kv": TinyLlamaSpec(
        num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8, hidden_size=512
    ),
}
# Results of another model than the default are saved as e.g. "c:llama-3.2-1b-kv".
MODEL_KEY_SEPARATOR = ":"


def add_e2e_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=MODELS,
        default=DEFAULT_MODEL,
        help="the served model: the embedded one, or a tiny Llama with Llama-3.2-1B's KV shape",
    )
    parser.add_argument("--rounds", type=int, default=1, help="measure every case this often")
    parser.add_argument("--requests", type=int, default=E2E_REQUESTS)
    parser.add_argument("--e2e-warmups", type=int, default=E2E_WARMUPS)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)


def run_end_to_end(args: argparse.Namespace) -> dict[str, Any]:
    """Parts (b) and/or (c), ``--rounds`` times over; ``pd`` is measured once a round."""
    check_example_config()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    if "pd-example" in CASES_OF_PART[args.part] and args.prompt_tokens % args.block_size == 0:
        # ExampleConnector looks a decode request's KV up under its prompt (the prefill's
        # prompt and first token) less one token, rounded down to whole blocks, and loads
        # it under the whole prompt rounded down: one block apart at these lengths, and
        # the missing file kills the decode engine.
        raise SystemExit(
            f"--prompt-tokens {args.prompt_tokens} is a multiple of the block size "
            f"({args.block_size}), where vLLM's ExampleConnector fails; take another length"
        )
    # Started in the background by a shell without job control (`cmd &`), this process
    # ignores SIGINT, `serve run` inherits that, and the launcher's SIGINT could not
    # stop the app. A handler of our own is reset to the default in children.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    rounds: list[dict[str, dict[str, Any]]] = []
    with own_ray_head() as address:
        # Cases take turns, so that a slow spell of the machine falls on all of them.
        for number in range(1, args.rounds + 1):
            measured: dict[str, dict[str, Any]] = {}
            for key in CASES_OF_PART[args.part]:
                console.print(f"[bold]{E2E_CASES[key][0]}[/], round {number}: starting")
                measured[key] = measure_case(key, address, args)
                console.print(f"{key}: {_brief(measured[key])}")
            rounds.append(measured)
    for number, measured in enumerate(rounds, 1):
        print_e2e_table(measured, args, number)
    workload = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "requests": args.requests,
        "warmups": args.e2e_warmups,
        "rounds": args.rounds,
        "arrivals": "sequential (one request at a time, the next sent when one ends)",
        "transfer_seconds_from": "splitserve_kv_transfer_seconds{op} on the router's /metrics",
    }
    parts: dict[str, Any] = {}
    suffix = "" if args.model == DEFAULT_MODEL else f"{MODEL_KEY_SEPARATOR}{args.model}"
    if "single" in rounds[0]:
        parts[f"b{suffix}"] = {"workload": workload, **part_b_summary(rounds)}
    if "pd-example" in rounds[0]:
        parts[f"c{suffix}"] = {"workload": workload, **part_c_summary(rounds)}
    print_verdicts(parts)
    return parts


def check_example_config() -> None:
    """The ExampleConnector YAML must be pd_always.yaml but for its kv_transfer block."""

    def args_of(path: Path) -> dict[str, Any]:
        args = dict(yaml.safe_load(path.read_text())["applications"][0]["args"])
        args.pop("kv_transfer", None)
        return args

    if args_of(PD_ALWAYS) != args_of(EXAMPLE_CONFIG):
        raise SystemExit(f"{EXAMPLE_CONFIG} drifted from {PD_ALWAYS} beyond kv_transfer")


@contextlib.contextmanager
def own_ray_head() -> Iterator[str]:
    """A Ray head in this process for the apps to join; it ends, with them, at exit."""
    # Never RAY_ADDRESS or a cluster another process started on this machine.
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(cluster_env())  # serve_run's apps take their port by direct ingress
    ray.init(address="local", num_cpus=HEAD_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def measure_case(key: str, address: str, args: argparse.Namespace) -> dict[str, Any]:
    config = case_config(key, args.model)
    kv_settings = load_app_config(config).kv_transfer.settings
    storage = getattr(kv_settings, "storage_path", None) if key == "pd-example" else None
    with _empty_folder(storage), serve_run(str(config), ray_address=address) as app:
        sequential_run(app.base_url, args.e2e_warmups, WARMUP_SEED, args)
        before = scrape(app.base_url)
        run = sequential_run(app.base_url, args.requests, MEASURED_SEED, args)
        time.sleep(METRICS_SETTLE_S)
        after = scrape(app.base_url)
    figures = case_figures(run, before, after)
    return figures


def case_config(key: str, model: str) -> Path:
    """The case's YAML, or a copy of it bound to one core and/or serving ``model``."""
    source = E2E_CASES[key][1] or SINGLE
    spec = MODELS[model]
    if key != "single-1core" and spec is None:
        return source
    document = yaml.safe_load(source.read_text())
    app_args = document["applications"][0]["args"]
    if key == "single-1core":
        (pool,) = app_args["pools"]
        pool["cpu_binds"] = [ONE_CORE_BIND]
    if spec is not None:
        app_args["model"]["source"] = str(embedded_model_path(spec))
        app_args["model"]["served_model_name"] = model
    path = Path(tempfile.mkdtemp(prefix="splitserve-bench-")) / f"{key}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@contextlib.contextmanager
def _empty_folder(path: str | None) -> Iterator[None]:
    """ExampleConnector's files: a stale one would be loaded as a hit; none may stay."""
    if path:
        shutil.rmtree(path, ignore_errors=True)
    try:
        yield
    finally:
        if path:
            shutil.rmtree(path, ignore_errors=True)


def sequential_run(base_url: str, requests: int, seed: int, args: argparse.Namespace) -> Any:
    """The project's load generator, one request at a time: TTFT is service time."""
    config = RunConfig(
        base_url=base_url,
        workload=WorkloadConfig(
            name="custom", input_len=args.prompt_tokens, output_len=args.output_tokens
        ),
        max_concurrency=1,
        num_requests=requests,
        warmup_requests=0,
        seed=seed,
        server_metrics=False,  # no /metrics polling beside the requests
        show_progress=False,
    )
    return asyncio.run(execute_run(config, Console(quiet=True)))


def scrape(base_url: str) -> dict[str, Any]:
    return parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)


def case_figures(run: Any, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    done = [m for m in run.requests if m.outcome == "ok" and m.ttft_s is not None]
    if not done:
        raise SystemExit("no request completed; see the serve log")
    figures: dict[str, Any] = {
        "completed": len(done),
        "requests": len(run.requests),
        "mean_prompt_tokens": statistics.fmean(m.input_tokens for m in done),
        "ttft": _dist_ms([m.ttft_s for m in done]),
        "itl": _dist_ms([gap for m in done for gap in m.itl_s]),
        # t2 - t1: where PD's decode-side load (get) lands.
        "first_gap": _dist_ms([m.itl_s[0] for m in done if m.itl_s]),
        "prefill_decisions": _delta(before, after, "splitserve_prefill_decisions_total", "where"),
    }
    transfer = transfer_figures(before, after)
    if transfer:
        ttft_mean = figures["ttft"]["mean_ms"]
        transfer["share_of_ttft"] = transfer["put_plus_get_ms"] / ttft_mean
        transfer["put_share_of_ttft"] = transfer["put"]["mean_ms"] / ttft_mean
        transfer["get_share_of_first_gap"] = (
            transfer["get"]["mean_ms"] / figures["first_gap"]["mean_ms"]
        )
        figures["transfer"] = transfer
    return figures


def transfer_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Mean put and get per transfer from the connector's histogram, this run only."""
    sums = _delta(before, after, catalogue.KV_SECONDS.sum, "op")
    counts = _delta(before, after, catalogue.KV_SECONDS.count, "op")
    nbytes = _delta(before, after, catalogue.KV_BYTES.total, "op")
    if not all(counts.get(op) for op in ("put", "get")):
        return None
    ops = {
        op: {
            "count": counts[op],
            "mean_ms": sums[op] / counts[op] * 1e3,
            "mean_bytes": nbytes.get(op, 0.0) / counts[op],
        }
        for op in ("put", "get")
    }
    outcomes = _delta(before, after, catalogue.KV_TRANSFERS.total, "outcome")
    return {
        **ops,
        "put_plus_get_ms": ops["put"]["mean_ms"] + ops["get"]["mean_ms"],
        "outcomes": outcomes,
        # Decode ranks' loads: "pushed" ahead of the request, or "claimed" when due.
        "loads": _delta(before, after, catalogue.KV_LOADS.total, "path"),
    }


def _delta(
    before: dict[str, Any], after: dict[str, Any], name: str, label: str
) -> dict[str, float]:
    def totals(samples: dict[str, Any]) -> dict[str, float]:
        sums: dict[str, float] = {}
        for labels, value in samples.get(name, []):
            sums[labels.get(label, "")] = sums.get(labels.get(label, ""), 0.0) + value
        return sums

    start = totals(before)
    return {key: value - start.get(key, 0.0) for key, value in totals(after).items()}


def _dist_ms(seconds: list[float]) -> dict[str, float]:
    values = np.array(seconds) * 1e3
    return {
        "count": int(values.size),
        "mean_ms": float(values.mean()),
        "p50_ms": float(np.percentile(values, 50)),
        "p90_ms": float(np.percentile(values, 90)),
    }


def _brief(figures: dict[str, Any]) -> str:
    text = (
        f"{figures['completed']}/{figures['requests']} ok, "
        f"TTFT p50 {figures['ttft']['p50_ms']:.1f} ms, ITL p50 {figures['itl']['p50_ms']:.2f} ms"
    )
    transfer = figures.get("transfer")
    if transfer:
        text += f", put+get {transfer['put_plus_get_ms']:.2f} ms"
    return text


def part_b_verdict(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    pd = measured["pd"]
    share = pd["transfer"]["share_of_ttft"] if "transfer" in pd else None
    return {
        "single": measured["single"],
        "single-1core": measured.get("single-1core"),
        "pd": pd,
        "ttft_p50_pd_over_single": pd["ttft"]["p50_ms"] / measured["single"]["ttft"]["p50_ms"],
        "itl_p50_pd_over_single": pd["itl"]["p50_ms"] / measured["single"]["itl"]["p50_ms"],
        "transfer_share_of_ttft": share,
        "meets_target": share is not None and share <= TARGET_SHARE,
    }


def part_b_summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    verdicts = [part_b_verdict(measured) for measured in rounds]
    return {
        "rounds": verdicts,
        "target_share": TARGET_SHARE,
        "meets_target": all(verdict["meets_target"] for verdict in verdicts),
    }


def part_c_verdict(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ours, theirs = measured["pd"], measured["pd-example"]

    def ratio(metric: str) -> float:
        return theirs[metric]["mean_ms"] / ours[metric]["mean_ms"]

    def second_token_ms(figures: dict[str, Any]) -> float:
        return figures["ttft"]["mean_ms"] + figures["first_gap"]["mean_ms"]

    transfer_ratio = None
    if "transfer" in ours and "transfer" in theirs:
        transfer_ratio = theirs["transfer"]["put_plus_get_ms"] / ours["transfer"]["put_plus_get_ms"]
    return {
        "pd": ours,
        "pd-example": theirs,
        # > 1: ExampleConnector takes that many times as long as ours. t2 is when the
        # decode engine has the KV and has computed its first token: the whole hand-over
        # as the client sees it.
        "example_over_ours": {
            "transfer_put_plus_get": transfer_ratio,
            "ttft_mean": ratio("ttft"),
            "first_gap_mean": ratio("first_gap"),
            "second_token_mean": second_token_ms(theirs) / second_token_ms(ours),
        },
    }


def part_c_summary(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per-round ratios, and their medians: ours is faster if both medians exceed 1."""
    verdicts = [part_c_verdict(measured) for measured in rounds]
    medians = {
        metric: statistics.median(
            verdict["example_over_ours"][metric] or 0.0 for verdict in verdicts
        )
        for metric in verdicts[0]["example_over_ours"]
    }
    return {
        "rounds": verdicts,
        "median_example_over_ours": medians,
        "ours_faster": medians["transfer_put_plus_get"] > 1 and medians["second_token_mean"] > 1,
    }


def print_e2e_table(
    measured: dict[str, dict[str, Any]], args: argparse.Namespace, number: int
) -> None:
    table = Table(
        title=f"End to end, {args.model} model, round {number} of {args.rounds}: "
        f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
        f"{args.requests} requests one at a time (ms)"
    )
    columns = ("case", "TTFT p50", "TTFT mean", "ITL p50", "ITL mean", "t2-t1 mean")
    for column in (*columns, "put mean", "get mean", "KiB moved", "(put+get) / TTFT"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for key, row in measured.items():
        transfer = row.get("transfer")
        cells = ["-"] * 4
        if transfer:
            cells = [
                f"{transfer['put']['mean_ms']:.2f}",
                f"{transfer['get']['mean_ms']:.2f}",
                f"{transfer['put']['mean_bytes'] / 2**10:.0f}",
                f"{transfer['share_of_ttft']:.1%}",
            ]
        table.add_row(
            E2E_CASES[key][0],
            f"{row['ttft']['p50_ms']:.1f}",
            f"{row['ttft']['mean_ms']:.1f}",
            f"{row['itl']['p50_ms']:.2f}",
            f"{row['itl']['mean_ms']:.2f}",
            f"{row['first_gap']['mean_ms']:.2f}",
            *cells,
        )
    Console(width=E2E_TABLE_WIDTH).print(table)


def print_verdicts(parts: dict[str, Any]) -> None:
    for key, part in parts.items():
        if key.startswith("b"):
            print_part_b(key, part)
        else:
            print_part_c(key, part)


def print_part_b(key: str, part: dict[str, Any]) -> None:
    for number, b in enumerate(part["rounds"], 1):
        console.print(
            f"({key}, round {number}) PD/single: TTFT p50 {b['ttft_p50_pd_over_single']:.2f}x, "
            f"ITL p50 {b['itl_p50_pd_over_single']:.2f}x; {_transfer_share_text(b)}"
        )
        one_core = b.get("single-1core")
        if one_core:
            ratio = b["pd"]["ttft"]["p50_ms"] / one_core["ttft"]["p50_ms"]
            console.print(f"    PD / single on one core: TTFT p50 {ratio:.2f}x")


def _transfer_share_text(b: dict[str, Any]) -> str:
    share = b["transfer_share_of_ttft"]
    if share is None:  # every prefill ran on the decode replica: nothing moved
        return f"no KV transfer measured, misses the {TARGET_SHARE:.0%} target"
    verdict = "meets" if b["meets_target"] else "misses"
    transfer = b["pd"]["transfer"]
    return (
        f"transfer (put+get) = {share:.1%} of PD's mean TTFT, {verdict} the "
        f"{TARGET_SHARE:.0%} target; put alone: {transfer['put_share_of_ttft']:.1%}; "
        f"loads by path {transfer['loads']}"
    )


def print_part_c(key: str, part: dict[str, Any]) -> None:
    rows = [(f"round {n}", c["example_over_ours"]) for n, c in enumerate(part["rounds"], 1)]
    rows.append(("median", part["median_example_over_ours"]))
    for label, ratios in rows:
        console.print(
            f"({key}, {label}) ExampleConnector / ours: "
            f"put+get {ratios['transfer_put_plus_get']:.2f}x, "
            f"TTFT mean {ratios['ttft_mean']:.2f}x, t2-t1 mean {ratios['first_gap_mean']:.2f}x, "
            f"t2 mean {ratios['second_token_mean']:.2f}x"
        )
    console.print(f"    -> ours {'faster' if part['ours_faster'] else 'NOT faster'}")


# ---- results file --------------------------------------------------------------------


def load_results(path: Path) -> dict[str, Any]:
    """Earlier parts' results, so that parts run separately end up in one file."""
    with contextlib.suppress(OSError, ValueError):
        results = json.loads(path.read_text())
        if isinstance(results, dict) and all(
            key.partition(MODEL_KEY_SEPARATOR)[0] in PARTS for key in results
        ):
            return results
    return {}


def save_results(path: Path, results: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    console.print(f"saved {path}")


def run_part_d(args: argparse.Namespace) -> dict[str, Any]:
    """Part (d): the same put and get between two Ray nodes of this machine, each with
    an object store of its own (Ray's object manager moves the bytes between them),
    against both sides on one node; milliseconds per MiB."""
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)
    store = (args.object_store_mib or DEFAULT_OBJECT_STORE_MIB) * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"kv_head": 1}, "object_store_memory": store},
    )
    cluster.add_node(num_cpus=1, resources={"kv_remote": 1}, object_store_memory=store)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        rows = {path: _placed_transfers(args, path) for path in ("same-node", "cross-node")}
    finally:
        ray.shutdown()
        cluster.shutdown()
    table = Table(title="(d) one request's KV, put on one node, got on the same or the other")
    for column in ("path", "MiB", "put ms", "get ms", "get ms/MiB", "vs same node"):
        table.add_column(column, justify="right")
    same = rows["same-node"]["get_ms_per_mib"]
    for path, row in rows.items():
        table.add_row(
            path, f"{row['mib']:.1f}", f"{row['put_ms']:.1f}", f"{row['get_ms']:.1f}",
            f"{row['get_ms_per_mib']:.3f}", f"{row['get_ms_per_mib'] / same:.2f}x",
        )  # fmt: skip
    console.print(table)
    return rows


def _placed_transfers(args: argparse.Namespace, path: str) -> dict[str, float]:
    shape = {key: getattr(args, key) for key in LLAMA_3_2_1B}
    blocks = -(-args.tokens // args.block_size)
    ids = list(range(1, blocks + 1))
    producer = KVEndpointActor.options(resources={"kv_head": 0.01}).remote(shape, blocks + 1, 1)
    where = "kv_head" if path == "same-node" else "kv_remote"
    consumer = KVEndpointActor.options(resources={where: 0.01}).remote(shape, blocks + 1, 2)
    puts, gets = [], []
    for _ in range(args.repeats + 2):  # the first two fault the stores' pages in
        refs, put_s = ray.get(producer.put.remote(ids, "request"))
        gets.append(ray.get(consumer.get.remote(refs, ids, "request")))
        puts.append(put_s)
        del refs
    if ray.get(producer.checksum.remote(ids)) != ray.get(consumer.checksum.remote(ids)):
        raise SystemExit(f"part (d), {path}: the decode side's pages differ")
    mib = blocks * args.block_size * _token_bytes(args) / 2**20
    get_s = statistics.median(gets[2:])
    return {
        "mib": mib,
        "put_ms": 1000 * statistics.median(puts[2:]),
        "get_ms": 1000 * get_s,
        "get_ms_per_mib": 1000 * get_s / mib,
    }


def run_part_a(args: argparse.Namespace) -> dict[str, Any]:
    shape = {key: getattr(args, key) for key in LLAMA_3_2_1B}
    # Whole blocks move, K and V.
    slots = -(-args.tokens // args.block_size) * args.block_size
    nbytes = slots * _token_bytes(args)
    # A cluster of our own: never RAY_ADDRESS or the cluster another process started here.
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=args.object_store_mib and args.object_store_mib * 2**20,
        _system_config={"preallocate_plasma_memory": args.preallocate_plasma},
    )
    try:
        results: dict[str, Any] = {"tokens": args.tokens, "nbytes": nbytes, "transfers": {}}
        results["numpy_copy"] = summarize(nbytes, numpy_copy_seconds(nbytes, args.repeats))
        for granularity in args.granularity:
            console.print(f"measuring granularity {granularity!r} ...")
            puts, gets, identical = transfer_seconds(args, granularity)
            if not identical:
                raise SystemExit(f"granularity {granularity}: decode cache differs from prefill")
            both = [put + get for put, get in zip(puts, gets, strict=True)]
            results["transfers"][granularity] = {
                "put": summarize(nbytes, puts),
                "get": summarize(nbytes, gets),
                "put+get": summarize(nbytes, both),
            }
    finally:
        ray.shutdown()
    print_tables(results)
    return {"shape": shape, **results}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--part", choices=PARTS, default="all")
    for key, default in LLAMA_3_2_1B.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="transfers before measuring; default: enough to have written the whole store",
    )
    parser.add_argument("--granularity", choices=GRANULARITIES, nargs="*", default=GRANULARITIES)
    parser.add_argument(
        "--object-store-mib",
        type=int,
        default=DEFAULT_OBJECT_STORE_MIB,
        help="part (a)'s object store; 0 for Ray's default (30%% of memory)",
    )
    parser.add_argument(
        "--preallocate-plasma",
        action="store_true",
        help="fault the object store's memory in at start (Ray's preallocate_plasma_memory)",
    )
    add_e2e_args(parser)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "kv_transfer.json")
    args = parser.parse_args()
    results = load_results(args.out)
    if args.part in ("a", "all"):
        results["a"] = run_part_a(args)
        save_results(args.out, results)
    if args.part in ("b", "c", "all"):
        results.update(run_end_to_end(args))
        save_results(args.out, results)
    if args.part in ("d", "all"):
        results["d"] = run_part_d(args)
        save_results(args.out, results)


if __name__ == "__main__":
    main()
