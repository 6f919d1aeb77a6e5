"""Read and write whole blocks of one worker's paged KV cache as numpy arrays.

On the CPU backend vLLM hands the connector one tensor per attention layer, shaped
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` ("LBHNC": per layer, per
block, head-major; within a (block, head) the keys of every slot come first, then the
values). A block is therefore one contiguous page per layer, and a transfer is a copy
of pages: we never need to know where K ends and V begins, only that both sides agree
on the page shape and dtype, which the connector checks before writing anything.

The wire format of one part (one worker rank) is ``list[layer] -> list[run]`` where a
run is a contiguous ``[n_blocks, *page]`` view of the cache. ``ray.put`` copies those
views straight into the object store (one copy, no staging buffer), and ``ray.get``
on the same node returns read-only arrays backed by the object store (zero copy); the
only copy on the decode side is into its own pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

# Element types numpy lacks travel as unsigned integers of the same width (bf16, fp8).
_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_NATIVE = {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8}

PackedLayers = list[list[np.ndarray]]


class PagedKVCache:
    """One worker rank's KV cache as per-layer numpy views sharing vLLM's memory."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("vLLM registered no KV cache tensors")
        first = tensors[0]
        for name, tensor in kv_caches.items():
            _check_layer_tensor(name, tensor, first, block_size)
        self._layers = [_as_numpy(tensor) for tensor in tensors]
        self.page_bytes = self._layers[0][0].nbytes
        # What both sides must agree on, byte for byte, before a part is written.
        self.layout: dict[str, Any] = {
            "num_layers": len(tensors),
            "page_shape": list(first.shape[1:]),
            "dtype": str(first.dtype).removeprefix("torch."),
        }

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def pack(self, block_ids: Sequence[int]) -> PackedLayers:
        """Views of these blocks in every layer, grouped into contiguous runs (no copy)."""
        runs = contiguous_runs(block_ids)
        return [[layer[start:stop] for start, stop in runs] for layer in self._layers]

    def pack_layer(self, layer: int, block_ids: Sequence[int]) -> list[np.ndarray]:
        return [self._layers[layer][start:stop] for start, stop in contiguous_runs(block_ids)]

    def unpack(
        self, packed: PackedLayers, first_source_block: int, block_ids: Sequence[int]
    ) -> int:
        """Write source blocks ``first_source_block...`` into ``block_ids``; bytes written."""
        if len(packed) != len(self._layers):
            raise ValueError(f"part has {len(packed)} layers, this cache {len(self._layers)}")
        for layer, runs in enumerate(packed):
            self.unpack_layer(layer, runs, first_source_block, block_ids)
        return len(block_ids) * self.page_bytes * len(self._layers)

    def unpack_layer(
        self,
        layer: int,
        runs: list[np.ndarray],
        first_source_block: int,
        block_ids: Sequence[int],
    ) -> None:
        destination = self._layers[layer]
        sources = _source_blocks(runs, first_source_block, len(block_ids))
        for block_id, source in zip(block_ids, sources, strict=True):
            if source.shape != destination.shape[1:] or source.dtype != destination.dtype:
                raise ValueError(
                    f"page {source.shape}/{source.dtype} does not fit "
                    f"{destination.shape[1:]}/{destination.dtype}"
                )
            np.copyto(destination[block_id], source)


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, stop), ...] covering ``block_ids`` in order with consecutive ids merged."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], block_id + 1)
        else:
            runs.append((block_id, block_id + 1))
    return runs


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
    name: str, tensor: torch.Tensor, first: torch.Tensor, block_size: int
) -> None:
    if tensor.device.type != "cpu":
        raise NotImplementedError(
            f"KV cache layer {name} is on {tensor.device}; the object-store connector "
            "copies pages with numpy and supports CPU KV caches only"
        )
    if tensor.shape != first.shape or tensor.dtype != first.dtype:
        raise ValueError(f"KV cache layer {name} differs from the first layer in shape/dtype")
    if not tensor.is_contiguous() or tensor.dim() != 4 or tensor.shape[2] != block_size:
        raise NotImplementedError(
            f"KV cache layer {name} has shape {tuple(tensor.shape)}; expected the CPU "
            f"backend's contiguous [num_blocks, kv_heads, block_size={block_size}, 2*head]"
        )


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in _NUMPY_NATIVE:
        return tensor.numpy()
    return tensor.view(_SAME_WIDTH_INTEGER[tensor.element_size()]).numpy()
