"""How fast does KV move through Ray's object store? (benchmark, not a test)

Part (a), host path: the KV of one 2,048-token prompt in the Llama-3.2-1B layout
(16 layers x 8 KV heads x 64 head dim x K and V x fp16 = 32 KiB per token, 64 MiB)
moves between two Ray actors, each holding a paged KV cache with vLLM's CPU layout.
"put" is the prefill side (pack the request's pages + ray.put), "get" the decode side
(ray.get + write the pages into its own cache), both with the connector's own
PagedKVCache. Baseline: one np.copyto of the same 64 MiB inside one process.

It also compares object granularities: one object per request per rank holding every
layer (what the connector does), the same through a staging buffer, and one object
per layer.

    python bench/kv_transfer.py [--tokens 2048] [--repeats 10] [--out results/kv_transfer.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from rich.console import Console
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parents[1]
console = Console()
GRANULARITIES = ("request", "request-staged", "layer")
TARGET_RATIO = 0.5


# Llama-3.2-1B's KV layout; 128 is vLLM's default block size on the CPU.
LLAMA_3_2_1B = {"layers": 16, "kv_heads": 8, "head_size": 64, "block_size": 128}
FP16_BYTES = 2


@ray.remote(num_cpus=0)
class KVEndpoint:
    """One side of a transfer: a paged KV cache in vLLM's CPU layout, fp16."""

    def __init__(self, shape: dict[str, int], num_blocks: int, seed: int) -> None:
        import torch

        from kv_transfer.paged_cache import PagedKVCache

        generator = torch.Generator().manual_seed(seed)
        page = (shape["kv_heads"], shape["block_size"], 2 * shape["head_size"])
        caches = {
            f"layer.{i}": torch.randn((num_blocks, *page), generator=generator).half()
            for i in range(shape["layers"])
        }
        self._cache = PagedKVCache(caches, shape["block_size"])

    def put(self, block_ids: list[int], granularity: str) -> tuple[list[ray.ObjectRef], float]:
        started = time.perf_counter()
        if granularity == "request":
            refs = [ray.put(self._cache.pack(block_ids))]
        elif granularity == "request-staged":
            staged = np.stack([np.concatenate(runs) for runs in self._cache.pack(block_ids)])
            refs = [ray.put(staged)]
        else:
            layers = range(self._cache.num_layers)
            refs = [ray.put(self._cache.pack_layer(layer, block_ids)) for layer in layers]
        return refs, time.perf_counter() - started

    def get(self, refs: list[ray.ObjectRef], block_ids: list[int], granularity: str) -> float:
        started = time.perf_counter()
        if granularity == "request":
            self._cache.unpack(ray.get(refs[0]), 0, block_ids)
        elif granularity == "request-staged":
            staged = ray.get(refs[0])
            self._cache.unpack([[layer] for layer in staged], 0, block_ids)
        else:
            for layer, ref in enumerate(refs):
                self._cache.unpack_layer(layer, ray.get(ref), 0, block_ids)
        return time.perf_counter() - started

    def checksum(self, block_ids: list[int]) -> float:
        packed = self._cache.pack(block_ids)
        return float(sum(run.astype(np.float64).sum() for runs in packed for run in runs))


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
    producer = KVEndpoint.remote(shape, num_blocks, seed=1)
    consumer = KVEndpoint.remote(shape, num_blocks, seed=2)
    puts, gets = [], []
    for iteration in range(args.warmup + args.repeats):
        refs, put_s = ray.get(producer.put.remote(source_blocks, granularity))
        get_s = ray.get(consumer.get.remote(refs, target_blocks, granularity))
        del refs
        if iteration >= args.warmup:
            puts.append(put_s)
            gets.append(get_s)
    identical = ray.get(producer.checksum.remote(source_blocks)) == ray.get(
        consumer.checksum.remote(target_blocks)
    )
    for actor in (producer, consumer):
        ray.kill(actor)
    return puts, gets, identical


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    for key, default in LLAMA_3_2_1B.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--granularity", choices=GRANULARITIES, nargs="*", default=GRANULARITIES)
    parser.add_argument("--object-store-mib", type=int, default=None)
    parser.add_argument(
        "--preallocate-plasma",
        action="store_true",
        help="fault the object store's memory in at start (Ray's preallocate_plasma_memory)",
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "kv_transfer.json")
    args = parser.parse_args()
    shape = {key: getattr(args, key) for key in LLAMA_3_2_1B}
    # Whole blocks move, K and V.
    slots = -(-args.tokens // args.block_size) * args.block_size
    nbytes = slots * args.layers * args.kv_heads * args.head_size * 2 * FP16_BYTES
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": shape, **results}, indent=2))
    console.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
