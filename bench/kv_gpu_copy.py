"""The KV connector's device copies on a GPU, against pinned cudaMemcpy (benchmark).

For a Llama-3.2-1B-shaped KV cache (16 layers, 8 KV heads, head size 64, blocks of 16
tokens) in fp16 and bf16, laid out as vLLM's CUDA attention backends lay it out
(FlashAttention's LBNHC, FlashInfer's LBHNC and BLHNC), it times what one transfer of
1k and 8k tokens costs with ``kv_transfer/object_store/paged_cache.py``: ``pack`` (gather on the
device on a side stream, into pinned host memory; its first call at a new size apart,
which pays the pinned allocation) and ``unpack`` (host to device, then scatter) from
pinned memory and from pageable memory, which is what ``ray.get`` hands the decode
side: through the connector's two pinned staging buffers, and, as the connector did
before them, straight from pageable memory. Beside them, the same bytes through plain
``cudaMemcpy`` from pinned and from pageable memory, measured in the same run. Only
torch is needed: the GPU machines this project borrows have no vLLM and no Ray.
``--device cpu`` runs the same code path on the CPU.

    python bench/kv_gpu_copy.py [--device cuda] [--repeats 20] [--out results/kv_gpu_copy.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# Llama-3.2-1B: 16 layers, 8 KV heads of 64; K and V of a slot are the content axis.
LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 16, 8, 64, 16
LAYOUTS = {"LBNHC": (0, 1, 3, 2, 4), "LBHNC": (0, 1, 2, 3, 4), "BLHNC": (1, 0, 2, 3, 4)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _paged_cache_module() -> Any:
    """kv_transfer/object_store/paged_cache.py on its own: the package imports Ray, which GPU
    machines without Ray do not have."""
    path = REPO_ROOT / "kv_transfer" / "paged_cache.py"
    spec = importlib.util.spec_from_file_location("paged_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["paged_cache"] = module
    spec.loader.exec_module(module)
    return module


def caches(layout: str, dtype: torch.dtype, blocks: int, device: str) -> dict[str, torch.Tensor]:
    order = LAYOUTS[layout]
    logical = (LAYERS, blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE)
    physical = torch.empty([logical[a] for a in order], dtype=dtype, device=device).normal_()
    view = physical.permute([order.index(axis) for axis in range(5)])
    return {f"layer.{i}": view[i] for i in range(LAYERS)}


def _timed_all(fn: Any, device: str, repeats: int) -> list[float]:
    """Every call's seconds, the two warm-ups first."""
    samples = []
    for _ in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return samples


def _timed(fn: Any, device: str, repeats: int) -> list[float]:
    return _timed_all(fn, device, repeats)[2:]


def memcpy_seconds(nbytes: int, device: str, repeats: int) -> dict[str, float]:
    """Plain copies of the same bytes: pinned both ways (the bandwidth ceiling), and
    host to device from pageable memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    pageable = torch.from_numpy(np.ones(nbytes, dtype=np.uint8))
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = _timed(lambda: host.copy_(device_buffer, non_blocking=True), device, repeats)
    h2d = _timed(lambda: device_buffer.copy_(host, non_blocking=True), device, repeats)
    pageable_h2d = _timed(lambda: device_buffer.copy_(pageable, non_blocking=True), device, repeats)
    return {
        "d2h_s": statistics.median(d2h),
        "h2d_s": statistics.median(h2d),
        "pageable_h2d_s": statistics.median(pageable_h2d),
    }


def _pageable(packed: Any) -> list[list[np.ndarray]]:
    """A part as ray.get hands it over: the same arrays in plain (pageable) memory."""
    return [[np.array(run, copy=True) for run in layer] for layer in packed]


def unpack_direct(target: Any, packed: Any, landing: list[int]) -> None:
    """The connector's load before its staging buffers: host to device straight from
    the part's memory, on the side stream (kept here as the baseline)."""
    ids = target._kernel_ids(landing)
    for layer, runs in zip(target._layers, packed, strict=True):
        source = torch.from_numpy(runs[0]).view(layer.dtype)[: len(ids)]
        with torch.cuda.stream(target._stream):
            layer.index_copy_(0, ids, source.to(target.device, non_blocking=True))
    target._stream.synchronize()


def measure(layout: str, dtype_name: str, tokens: int, device: str, repeats: int) -> dict:
    paged_cache = _paged_cache_module()
    blocks = tokens // BLOCK
    capacity = 2 * blocks + 8
    source_layers = caches(layout, DTYPES[dtype_name], capacity, device)
    target_layers = caches(layout, DTYPES[dtype_name], capacity, device)
    source = paged_cache.PagedKVCache(source_layers, BLOCK)
    target = paged_cache.PagedKVCache(target_layers, BLOCK)
    ids = list(range(1, 2 * blocks, 2))  # scattered, as a busy cache hands them out
    landing = list(range(blocks))
    nbytes = blocks * source.page_bytes * LAYERS
    # Only the last pack is kept, as the connector frees each once it is in the object
    # store: holding them all made every timed pack a fresh pinned allocation (on an
    # H200 the first layout read 28 ms for 1k tokens against 1.1 ms once reused).
    packed: list[Any] = [None]

    def pack_once() -> None:
        packed[0] = None
        packed[0] = source.pack(ids, after=source.writes_done())

    pack_all = _timed_all(pack_once, device, repeats)
    pack = pack_all[2:]
    unpack = _timed(lambda: target.unpack(packed[0], 0, landing), device, repeats)
    pageable = _pageable(packed[0])
    staged = _timed(lambda: target.unpack(pageable, 0, landing), device, repeats)
    if device == "cuda":
        torch.cuda.synchronize()
    # The round trip must be byte-exact: every moved page lands where it was sent.
    exact = all(
        torch.equal(source_layers[name][ids], target_layers[name][landing])
        for name in source_layers
    )
    direct = staged
    if device == "cuda":
        direct = _timed(lambda: unpack_direct(target, pageable, landing), device, repeats)
    ceiling = memcpy_seconds(nbytes, device, repeats)
    pack_s, unpack_s = statistics.median(pack), statistics.median(unpack)
    staged_s, direct_s = statistics.median(staged), statistics.median(direct)
    return {
        "layout": layout, "dtype": dtype_name, "tokens": tokens, "mib": nbytes / 2**20,
        "byte_exact": exact, "pack_ms": 1000 * pack_s, "unpack_ms": 1000 * unpack_s,
        "first_pack_ms": 1000 * pack_all[0],
        "unpack_pageable_staged_ms": 1000 * staged_s,
        "unpack_pageable_direct_ms": 1000 * direct_s,
        "memcpy_d2h_ms": 1000 * ceiling["d2h_s"], "memcpy_h2d_ms": 1000 * ceiling["h2d_s"],
        "memcpy_pageable_h2d_ms": 1000 * ceiling["pageable_h2d_s"],
        "pack_gib_s": nbytes / pack_s / 2**30, "unpack_gib_s": nbytes / unpack_s / 2**30,
        "unpack_pageable_staged_gib_s": nbytes / staged_s / 2**30,
        "unpack_pageable_direct_gib_s": nbytes / direct_s / 2**30,
        "memcpy_d2h_gib_s": nbytes / ceiling["d2h_s"] / 2**30,
        "memcpy_h2d_gib_s": nbytes / ceiling["h2d_s"] / 2**30,
        "memcpy_pageable_h2d_gib_s": nbytes / ceiling["pageable_h2d_s"] / 2**30,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", default="1024,8192")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "kv_gpu_copy.json")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device: {name}; torch {torch.__version__}")
    rows = []
    header = f"{'layout':6} {'dtype':5} {'tokens':>6} {'MiB':>6} {'pack':>6} {'first':>6}"
    header += f" {'unpack pinned':>13} {'pageable staged':>15} {'direct':>7}"
    header += f" {'memcpy d2h/h2d/pageable h2d GiB/s':>34} exact"
    print(header + "   (ms, GiB/s in brackets)")
    for layout in LAYOUTS:
        for dtype_name in DTYPES:
            for tokens in map(int, args.tokens.split(",")):
                row = measure(layout, dtype_name, tokens, args.device, args.repeats)
                rows.append(row)
                print(
                    f"{layout:6} {dtype_name:5} {tokens:6d} {row['mib']:6.1f}"
                    f" {row['pack_ms']:6.2f} {row['first_pack_ms']:6.1f}"
                    f" {row['unpack_ms']:6.2f} ({row['unpack_gib_s']:4.1f})"
                    f" {row['unpack_pageable_staged_ms']:7.2f}"
                    f" ({row['unpack_pageable_staged_gib_s']:4.1f})"
                    f" {row['unpack_pageable_direct_ms']:7.2f}"
                    f" {row['memcpy_d2h_gib_s']:10.1f}/{row['memcpy_h2d_gib_s']:.1f}/"
                    f"{row['memcpy_pageable_h2d_gib_s']:.1f}"
                    f" {row['byte_exact']}"
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    print(f"saved {args.out}")
    if not all(row["byte_exact"] for row in rows):
        sys.exit("a round trip was not byte-exact")


if __name__ == "__main__":
    main()
