"""Read and write whole blocks of one worker's paged KV cache, on the CPU or a GPU.

vLLM 0.32 hands a KV connector one view per attention layer with the logical shape
``[blocks, kv heads, tokens per block, content]`` ("BHNC"; content is K and V of one
slot, in bytes of the cache dtype); how those axes lie in memory is the attention
backend's ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``): LBHNC on the CPU backend,
LBNHC (token-major) for FlashAttention, LBHNC or BLHNC for FlashInfer's kernels,
layer-outermost or block-outermost. A transfer always carries blocks in the logical
order, so both sides only have to agree on the logical page (which the handle's
layout fingerprint checks), not on the backend: a FlashInfer prefill engine can hand
its KV to a FlashAttention decode engine.

Two ways to move blocks, one interface:
- **views** (a CPU cache whose layers are contiguous, the CPU backend's): a part is a
  list of contiguous ``[n_blocks, *page]`` runs per layer, numpy views of the cache;
  ``ray.put`` makes the only copy on the prefill side and the write into the pages the
  only one on the decode side.
- **gather** (any other layout, and every GPU cache): per layer, the blocks are
  gathered on the cache's device (``index_select``) into ``[n, *page]``; on a GPU this
  runs on a side CUDA stream after the forward pass's writes and lands in pinned host
  memory, so it overlaps the next step's compute; loading is the reverse
  (``index_copy_`` on the side stream, waited for before the load is reported done).
  What ``ray.get`` hands the decode side is the object store's pageable memory, from
  which a host-to-device copy is synchronous and slower than from pinned memory, so a
  GPU load stages each layer through one of two pinned buffers: the CPU fills one while
  the GPU reads the other (``_PinnedStaging``; bench/kv_gpu_copy.py measures both).

The wire format of one part is ``list[layer] -> list[run]`` of numpy arrays in either
case; ``unpack`` takes both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

# Element types numpy lacks travel as unsigned integers of the same width (bf16, fp8).
_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_NATIVE = {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8}

PackedLayers = list[list[np.ndarray]]


class UnsupportedKVCacheError(NotImplementedError):
    """A KV cache this connector cannot move; the message names what and why."""


class PagedKVCache:
    """One worker rank's KV cache, every attention layer, by block."""

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], block_size: int, backend: str = "unknown"
    ) -> None:
        """``block_size``: the scheduler's block, in tokens; a kernel that splits it in
        smaller kernel blocks (the view's third axis) is handled. ``backend``: the
        attention backend's name, for error messages."""
        tensors = list(kv_caches.values())
        if not tensors:
            raise UnsupportedKVCacheError("vLLM registered no KV cache tensors")
        first = tensors[0]
        for name, tensor in kv_caches.items():
            _check_layer_tensor(name, tensor, first, block_size, backend)
        self._layers = tensors
        self.device = first.device
        # Kernel blocks per scheduler block (1 unless the kernel splits blocks).
        self._ratio = block_size // first.shape[2]
        self._as_views = (
            self.device.type == "cpu"
            and self._ratio == 1
            and all(t.is_contiguous() for t in tensors)
        )
        self._numpy = [_as_numpy(t) for t in tensors] if self._as_views else []
        self.page_bytes = first[0].numel() * first.element_size() * self._ratio
        # What both sides must agree on, byte for byte, before a part is written: the
        # logical page (kernel block) and how many make a scheduler block.
        self.layout: dict[str, Any] = {
            "num_layers": len(tensors),
            "page_shape": list(first.shape[1:]),
            "dtype": str(first.dtype).removeprefix("torch."),
        }
        if self._ratio != 1:
            self.layout["kernel_blocks_per_block"] = self._ratio
        self._stream: Any = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
        # Loads run on several threads (kv_transfer/object_store/worker.py): a stager each.
        self._stagers = threading.local()

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def moves_views(self) -> bool:
        """Blocks travel as views of the cache (zero staging), not gathered copies."""
        return self._as_views

    def writes_done(self) -> Any:
        """A marker of the KV written so far (a CUDA event on a GPU, else None); ``pack``
        waits for it, so it can run on another thread while the next step computes."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def pack(self, block_ids: Sequence[int], after: Any = None) -> PackedLayers:
        """These blocks of every layer, in logical order: views (CPU, contiguous) or
        gathered copies in host memory. ``after``: ``writes_done()``'s marker."""
        if self._as_views:
            runs = contiguous_runs(block_ids)
            return [[layer[start:stop] for start, stop in runs] for layer in self._numpy]
        kernel_ids = self._kernel_ids(block_ids)
        return [[_as_numpy(host)] for host in self._gather(kernel_ids, after)]

    def unpack(
        self, packed: PackedLayers, first_source_block: int, block_ids: Sequence[int]
    ) -> int:
        """Write source blocks ``first_source_block...`` into ``block_ids``; bytes written."""
        if len(packed) != len(self._layers):
            raise ValueError(f"part has {len(packed)} layers, this cache {len(self._layers)}")
        if self._as_views:
            for layer, runs in enumerate(packed):
                self._write_views(layer, runs, first_source_block, block_ids)
        else:
            self._scatter(packed, first_source_block, block_ids)
        return len(block_ids) * self.page_bytes * len(self._layers)

    # ---- views (CPU, contiguous layers) -----------------------------------------------

    def _write_views(
        self, layer: int, runs: list[np.ndarray], first_source_block: int, block_ids: Sequence[int]
    ) -> None:
        destination = self._numpy[layer]
        sources = _source_blocks(runs, first_source_block, len(block_ids))
        for block_id, source in zip(block_ids, sources, strict=True):
            if source.shape != destination.shape[1:] or source.dtype != destination.dtype:
                raise ValueError(
                    f"page {source.shape}/{source.dtype} does not fit "
                    f"{destination.shape[1:]}/{destination.dtype}"
                )
            np.copyto(destination[block_id], source)

    # ---- gather and scatter (any layout, any device) ----------------------------------

    def _kernel_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        ratio = self._ratio
        ids = [block * ratio + k for block in block_ids for k in range(ratio)]
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _gather(self, kernel_ids: torch.Tensor, after: Any) -> list[torch.Tensor]:
        if self._stream is None:
            return [layer.index_select(0, kernel_ids) for layer in self._layers]
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)  # the forward pass's writes come first
            hosts = []
            for layer in self._layers:
                gathered = layer.index_select(0, kernel_ids)
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                hosts.append(host)
        self._stream.synchronize()
        return hosts

    def _scatter(
        self, packed: PackedLayers, first_source_block: int, block_ids: Sequence[int]
    ) -> None:
        ratio = self._ratio
        kernel_ids = self._kernel_ids(block_ids)
        start, stop = first_source_block * ratio, (first_source_block + len(block_ids)) * ratio
        for layer, runs in zip(self._layers, packed, strict=True):
            source = _concatenated(runs, layer.dtype, layer.shape[1:])[start:stop]
            if len(source) != len(kernel_ids):
                raise ValueError("the transferred part holds fewer blocks than the load needs")
            if self._stream is None:
                layer.index_copy_(0, kernel_ids, source)
                continue
            self._load_on_device(layer, kernel_ids, source)
        if self._stream is not None:
            self._stream.synchronize()  # written before the load is reported done

    def _load_on_device(
        self, layer: torch.Tensor, kernel_ids: torch.Tensor, source: torch.Tensor
    ) -> None:
        staged, slot = source, None
        if not source.is_pinned():
            staged, slot = self._stager().stage(source)
        with torch.cuda.stream(self._stream):
            layer.index_copy_(0, kernel_ids, staged.to(self.device, non_blocking=True))
            if slot is not None:
                self._stager().read_issued(slot, self._stream)

    def _stager(self) -> _PinnedStaging:
        stager = getattr(self._stagers, "stager", None)
        if stager is None:
            stager = self._stagers.stager = _PinnedStaging()
        return stager


class _PinnedStaging:
    """Two pinned host buffers that a GPU load copies pageable layers through in turn:
    the CPU fills one while the GPU still reads the other, and a buffer is refilled only
    once the copy that reads it has finished (its CUDA event)."""

    SLOTS = 2

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self._read: list[Any] = [None] * self.SLOTS  # CUDA events, one per slot
        self._next = 0

    def stage(self, source: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``source`` copied into the next pinned buffer, and that buffer's slot."""
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        if self._read[slot] is not None:
            self._read[slot].synchronize()  # the GPU has read what the buffer held
        nbytes = source.numel() * source.element_size()
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = buffer[:nbytes].view(source.dtype).view(source.shape)
        staged.copy_(source)
        return staged, slot

    def read_issued(self, slot: int, stream: Any) -> None:
        """The copy that reads ``slot`` is queued on ``stream``: mark when it finishes."""
        event = torch.cuda.Event()
        event.record(stream)
        self._read[slot] = event


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering ``block_ids`` in order with consecutive ids merged."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs


def _concatenated(runs: list[np.ndarray], dtype: torch.dtype, page: torch.Size) -> torch.Tensor:
    """The runs of one layer as one ``[kernel blocks, *page]`` tensor of ``dtype``."""
    arrays = [np.ascontiguousarray(run) for run in runs]
    joined = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    tensor = torch.from_numpy(joined)
    if tensor.dtype != dtype:
        tensor = tensor.view(dtype)  # bf16/fp8 travel as integers of their width
    if tuple(tensor.shape[1:]) != tuple(page):
        raise ValueError(f"pages of {tuple(tensor.shape[1:])} do not fit {tuple(page)}")
    return tensor


def _source_blocks(runs: list[np.ndarray], first: int, count: int) -> Iterator[np.ndarray]:
    """The ``count`` pages starting at page ``first`` of the concatenated runs."""
    skip = first
    for run in runs:
        if skip >= len(run):
            skip -= len(run)
            continue
        for page in run[skip:]:
            if count == 0:
                return
            yield page
            count -= 1
        skip = 0
    if count:
        raise ValueError("the transferred part holds fewer blocks than the load needs")


def _check_layer_tensor(
    name: str, tensor: torch.Tensor, first: torch.Tensor, block_size: int, backend: str
) -> None:
    if tensor.dim() != 4:
        raise UnsupportedKVCacheError(
            f"KV cache layer {name} of attention backend {backend} has shape"
            f" {tuple(tensor.shape)}; the object-store connector moves vLLM's per-layer"
            " [blocks, kv heads, tokens, content] views only"
        )
    if tensor.shape != first.shape or tensor.dtype != first.dtype:
        raise UnsupportedKVCacheError(
            f"KV cache layer {name} differs from the first layer in shape or dtype"
            f" (backend {backend}); one KV cache group of identical layers is supported"
        )
    if tensor.device != first.device or tensor.device.type not in ("cpu", "cuda"):
        raise UnsupportedKVCacheError(
            f"KV cache layer {name} is on {tensor.device} (backend {backend}); the"
            " object-store connector supports CPU and CUDA caches"
        )
    if block_size % tensor.shape[2]:
        raise UnsupportedKVCacheError(
            f"KV cache layer {name} has blocks of {tensor.shape[2]} tokens, which do not"
            f" divide the scheduler's {block_size} (backend {backend})"
        )


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in _NUMPY_NATIVE:
        return tensor.numpy()
    return tensor.view(_SAME_WIDTH_INTEGER[tensor.element_size()]).numpy()
