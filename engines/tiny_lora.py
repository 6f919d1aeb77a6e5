"""A deterministic tiny LoRA adapter for the embedded model.

It has random A and B matrices from a seed, written in the folder layout PEFT saves,
so the LoRA paths of vLLM (load, route by name, unload) run offline without peft.
B is not zero, unlike PEFT's own init: an adapter that changes nothing would prove
nothing. The folder is built once into a cache and reused; building twice gives the
same bytes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

from engines.tiny_model import (
    EMBEDDED_MODEL_NAME,
    TinyLlamaSpec,
    default_cache_dir,
    embedded_model_path,
)

ADAPTER_PREFIX = f"{EMBEDDED_MODEL_NAME}-lora"
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


class TinyLoraSpec(BaseModel, frozen=True):
    """Shape of one adapter; different seeds give different adapters."""

    seed: int = 1
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ATTENTION_MODULES + MLP_MODULES
    # Large enough that greedy output moves away from the base model's.
    init_std: float = 0.5
    base: TinyLlamaSpec = TinyLlamaSpec()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


def tiny_lora_path(spec: TinyLoraSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Folder of the adapter, building it (and the base model it names) on first use."""
    spec = spec or TinyLoraSpec()
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / f"{ADAPTER_PREFIX}-{spec.fingerprint()}"
    if (target / CONFIG_FILE).exists():
        return target
    base_path = embedded_model_path(spec.base, cache_dir)
    # Build beside the target and rename, so concurrent builders never see half an adapter.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        build_tiny_lora(staging, spec, base_path)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / CONFIG_FILE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_lora(folder: Path, spec: TinyLoraSpec, base_path: Path) -> None:
    """Write the PEFT config and weights of the adapter into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_config(folder, spec, base_path)
    _write_weights(folder, spec)


def _write_config(folder: Path, spec: TinyLoraSpec, base_path: Path) -> None:
    config = {
        "base_model_name_or_path": str(base_path),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "peft_type": "LORA",
        "r": spec.rank,
        "target_modules": sorted(spec.target_modules),
        "task_type": "CAUSAL_LM",
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_weights(folder: Path, spec: TinyLoraSpec) -> None:
    import torch
    from safetensors.torch import save_file

    shapes = module_shapes(spec.base)
    unknown = set(spec.target_modules) - shapes.keys()
    if unknown:
        raise ValueError(f"not a module of the tiny Llama: {sorted(unknown)}")
    # Fill every tensor from our own generator, in name order, as the base model does.
    generator = torch.Generator().manual_seed(spec.seed)
    state = {}
    for name, shape in sorted(_lora_shapes(spec).items()):
        state[name] = torch.randn(shape, generator=generator) * spec.init_std
    save_file(state, str(folder / WEIGHTS_FILE))


def _lora_shapes(spec: TinyLoraSpec) -> dict[str, tuple[int, int]]:
    shapes = module_shapes(spec.base)
    result: dict[str, tuple[int, int]] = {}
    for layer in range(spec.base.num_hidden_layers):
        for module in spec.target_modules:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            out_features, in_features = shapes[module]
            result[f"{prefix}.lora_A.weight"] = (spec.rank, in_features)
            result[f"{prefix}.lora_B.weight"] = (out_features, spec.rank)
    return result


def module_shapes(base: TinyLlamaSpec) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear module in a decoder layer."""
    head_dim = base.hidden_size // base.num_attention_heads
    hidden, kv = base.hidden_size, base.num_key_value_heads * head_dim
    return {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (base.intermediate_size, hidden),
        "up_proj": (base.intermediate_size, hidden),
        "down_proj": (hidden, base.intermediate_size),
    }
