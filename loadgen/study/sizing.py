"""How many devices a shape needs, and how to lay them out (the advisor's sizing).

From what a sweep measured (each shape's goodput at its measured size) and what the
advisor fitted (PD's per-engine capacities), this sizes a deployment for a target
request rate or a device budget:

- **single, dp** (mixed engines): goodput grows with engines at the measured goodput per
  engine (fitted: the sweep measured one size);
- **auto** (one mixed pool whose engines are each able to prefill for another): grows like dp, from
  two engines up (one engine alone has nobody to hand a prompt to);
- **tp, pp**: one engine of the measured degree (the shape holds one engine);
- **pd, pd_always**: ``p`` prefill and ``d`` decode engines serve
  ``min(p x C_p, d x C_d)`` req/s, DistServe's ratio: for a rate, the fewest of each
  that reach it; for a budget, the pair with the highest goodput. ``C_p`` and ``C_d``
  are the advisor's fit scaled to what the measured layout served (``calibrated``).

The tensor-parallel degrees a model allows come from its ``config.json`` (attention
heads divisible by the degree, KV heads divisible by it or it by them, as vLLM
requires), and the smallest degree whose share of the weights fits one device is the
floor for every engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIXED_SHAPES = ("single", "dp")
AUTO_POOL_SHAPES = ("auto",)
MIN_AUTO_POOL_ENGINES = 2  # the fewest engines an auto pool takes (the config's rule)
ONE_ENGINE_SHAPES = ("tp", "pp")
PD_SHAPES = ("pd", "pd_always")
# The weights may take at most this share of what an engine may use of a device: the
# rest holds the KV cache, without which the engine serves a handful of requests.
WEIGHT_SHARE_MAX = 0.6
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1, "int8": 1}
# A budget larger than this is not searched pair by pair (a pool of a thousand GPUs is
# not sized from a two-device sweep anyway).
PAIR_SEARCH_MAX_DEVICES = 256


@dataclass(frozen=True)
class Layout:
    """A deployment's pools as its YAML holds them."""

    pools: tuple[tuple[str, int], ...]  # (role, replicas) of each pool
    ranks_per_engine: int  # tensor x pipeline parallel degree

    @property
    def engines(self) -> int:
        return sum(replicas for _, replicas in self.pools)

    @property
    def devices(self) -> int:
        return self.engines * self.ranks_per_engine


@dataclass(frozen=True)
class MeasuredSize:
    """One shape as the sweep measured it: its goodput at its YAML's layout."""

    shape: str
    goodput: float  # req/s within the objectives (the knee)
    layout: Layout

    @property
    def pools(self) -> tuple[tuple[str, int], ...]:
        return self.layout.pools

    @property
    def ranks_per_engine(self) -> int:
        return self.layout.ranks_per_engine

    @property
    def engines(self) -> int:
        return self.layout.engines

    @property
    def devices(self) -> int:
        return self.layout.devices


@dataclass(frozen=True)
class PDCapacities:
    """What one prefill and one decode engine serve, in req/s (fitted)."""

    prefill: float
    decode: float


def calibrated(pd: PDCapacities, measured: MeasuredSize) -> PDCapacities:
    """The fitted capacities scaled so that the measured layout serves what the sweep
    measured: the fit gives the shape (which pool runs out first), the runs the level."""
    pools = dict(measured.pools)
    fitted = _pd_goodput(pd, pools.get("prefill", 1), pools.get("decode", 1))
    scale = measured.goodput / fitted if fitted > 0 else 0.0
    return PDCapacities(pd.prefill * scale, pd.decode * scale)


@dataclass(frozen=True)
class Sizing:
    """A deployment: engines per pool role, their parallel degree, what it serves."""

    shape: str
    engines: dict[str, int]  # role -> replicas ("mixed", or "prefill" and "decode")
    ranks_per_engine: int
    goodput: float
    measured: bool  # the sweep measured this size; else it is extrapolated or fitted
    measured_shape: str  # the shape whose measurement it is sized from

    @property
    def devices(self) -> int:
        return sum(self.engines.values()) * self.ranks_per_engine


def size_for_rate(
    measured: MeasuredSize, rate: float, pd: PDCapacities | None = None
) -> Sizing | None:
    """The fewest devices that serve ``rate`` req/s in this shape; None where the shape
    cannot (it met the objectives at no rate, or it holds one engine and that is short)."""
    if measured.shape in PD_SHAPES and pd is not None:
        pd = calibrated(pd, measured)
        if min(pd.prefill, pd.decode) <= 0:
            return None
        prefill, decode = math.ceil(rate / pd.prefill), math.ceil(rate / pd.decode)
        return _pd_sizing(measured, prefill, decode, pd)
    per_engine = measured.goodput / measured.engines
    if per_engine <= 0:
        return None
    if measured.shape in ONE_ENGINE_SHAPES or measured.shape in PD_SHAPES:
        if rate > measured.goodput:
            return None
        return _as_measured(measured)
    engines = max(_fewest_engines(measured), math.ceil(rate / per_engine))
    return _mixed_sizing(measured, engines)


def size_for_devices(
    measured: MeasuredSize, devices: int, pd: PDCapacities | None = None
) -> Sizing | None:
    """The highest-goodput layout of at most ``devices`` devices in this shape."""
    ranks = measured.ranks_per_engine
    if devices < ranks:
        return None
    if measured.shape in PD_SHAPES and pd is not None:
        pd = calibrated(pd, measured)
        pairs = [
            (prefill, engines - prefill)
            for engines in range(2, min(devices, PAIR_SEARCH_MAX_DEVICES) // ranks + 1)
            for prefill in range(1, engines)
        ]
        if not pairs:
            return None
        best = max(pairs, key=lambda pair: (_pd_goodput(pd, *pair), -sum(pair)))
        return _pd_sizing(measured, best[0], best[1], pd)
    if measured.shape in MIXED_SHAPES or measured.shape in AUTO_POOL_SHAPES:
        engines = devices // ranks
        return _mixed_sizing(measured, engines) if engines >= _fewest_engines(measured) else None
    return _as_measured(measured) if devices >= measured.devices else None


def pareto_points(
    measured: list[MeasuredSize], max_devices: int, pd: PDCapacities | None = None
) -> list[Sizing]:
    """Every shape's best layout at each device count up to ``max_devices``."""
    points = []
    for size in measured:
        for devices in range(1, max_devices + 1):
            sizing = size_for_devices(size, devices, pd)
            if sizing is not None and sizing.devices == devices and sizing.goodput > 0:
                points.append(sizing)
    return points


def pareto_front(points: list[Sizing]) -> list[Sizing]:
    """The layouts no other beats on goodput without more devices, by devices; between
    equals, the one the sweep measured."""
    front: list[Sizing] = []
    for point in sorted(points, key=lambda p: (p.devices, -p.goodput, not p.measured)):
        if not front or point.goodput > front[-1].goodput:
            front.append(point)
    return front


def _pd_goodput(pd: PDCapacities, prefill: int, decode: int) -> float:
    return min(prefill * pd.prefill, decode * pd.decode)


def _pd_sizing(measured: MeasuredSize, prefill: int, decode: int, pd: PDCapacities) -> Sizing:
    engines = {"prefill": prefill, "decode": decode}
    return Sizing(
        measured.shape,
        engines,
        measured.ranks_per_engine,
        _pd_goodput(pd, prefill, decode),
        measured=engines == dict(measured.pools),
        measured_shape=measured.shape,
    )


def _fewest_engines(measured: MeasuredSize) -> int:
    return MIN_AUTO_POOL_ENGINES if measured.shape in AUTO_POOL_SHAPES else 1


def _mixed_sizing(measured: MeasuredSize, engines: int) -> Sizing:
    per_engine = measured.goodput / measured.engines
    shape = "single" if engines == 1 else "dp"
    if measured.shape in AUTO_POOL_SHAPES:
        shape = measured.shape
    return Sizing(
        shape,
        {"mixed": engines},
        measured.ranks_per_engine,
        per_engine * engines,
        measured=engines == measured.engines,
        measured_shape=measured.shape,
    )


def _as_measured(measured: MeasuredSize) -> Sizing:
    roles = {"prefill": 1, "decode": 1} if measured.shape in PD_SHAPES else {"mixed": 1}
    return Sizing(
        measured.shape, roles, measured.ranks_per_engine, measured.goodput, True, measured.shape
    )


# ---- the model's tensor-parallel degrees -----------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """What sizing needs of a model's ``config.json``."""

    attention_heads: int
    kv_heads: int
    weight_bytes: int

    def tp_degrees(self, devices_per_node: int) -> list[int]:
        """Tensor-parallel degrees vLLM can split this model by, within one node."""
        return [
            degree
            for degree in range(1, devices_per_node + 1)
            if self.attention_heads % degree == 0
            and (self.kv_heads % degree == 0 or degree % self.kv_heads == 0)
        ]

    def smallest_fitting_tp(
        self, devices_per_node: int, device_gib: float, utilization: float
    ) -> int | None:
        """The smallest allowed degree whose share of the weights fits one device."""
        budget = device_gib * 2**30 * utilization * WEIGHT_SHARE_MAX
        for degree in self.tp_degrees(devices_per_node):
            if self.weight_bytes / degree <= budget:
                return degree
        return None


def model_dims(config: dict[str, Any]) -> ModelDims:
    """Heads and weight bytes of a decoder-only transformer (Llama-shaped: attention,
    gated MLP, embeddings), from its Hugging Face ``config.json``."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
        intermediate = int(config.get("intermediate_size", 4 * hidden))
    except KeyError as missing:
        message = f"config.json has no {missing}: not a decoder this advisor sizes"
        raise ValueError(message) from None
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim", hidden // heads))
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * intermediate
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    parameters = layers * (attention + mlp) + embeddings
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelDims(heads, kv_heads, parameters * DTYPE_BYTES.get(dtype, 2))


def read_model_config(model: str) -> dict[str, Any] | None:
    """A model's ``config.json``: from a local folder, or from the Hugging Face cache
    when the id was downloaded before; None where neither has it (nothing is fetched)."""
    folder = Path(model).expanduser()
    if (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text())
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, "config.json")
    return json.loads(Path(cached).read_text()) if isinstance(cached, str) else None
