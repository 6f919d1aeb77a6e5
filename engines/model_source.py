"""Turn the ``model.source`` of a config into something vLLM and a tokenizer can load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.settings import EMBEDDED_SOURCE, ModelConfig, embedded_lora_seed, embedded_seed
from engines.tiny_model import EMBEDDED_MODEL_NAME, TinyLlamaSpec, embedded_model_path


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # a local folder or a Hugging Face id
    served_name: str


def served_name_of(config: ModelConfig) -> str:
    """The name clients send in ``model``, known without building or loading anything."""
    if config.served_model_name:
        return config.served_model_name
    seed = embedded_seed(config.source)
    if seed is None:
        return config.source
    # Each embedded variant is another model (other weights), so it has its own name.
    return EMBEDDED_MODEL_NAME if seed == 0 else f"{EMBEDDED_MODEL_NAME}-{seed}"


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Build the embedded model if asked for; pass local folders and hub ids through."""
    seed = embedded_seed(config.source)
    if seed is not None:
        path = str(embedded_model_path(TinyLlamaSpec(seed=seed)))
    else:
        local = Path(config.source).expanduser()
        path = str(local.resolve()) if local.exists() else config.source
    return ResolvedModel(path=path, served_name=served_name_of(config))


def resolve_adapter_path(path: str) -> str:
    """Where an adapter's files are on this node: the tiny embedded adapter is built here
    on first use (each node builds its own, as it does the embedded model)."""
    seed = embedded_lora_seed(path)
    if seed is None:
        local = Path(path).expanduser()
        return str(local.resolve()) if local.exists() else path
    from engines.tiny_lora import TinyLoraSpec, tiny_lora_path

    return str(tiny_lora_path(TinyLoraSpec(seed=seed)))


__all__ = [
    "EMBEDDED_SOURCE",
    "ResolvedModel",
    "resolve_adapter_path",
    "resolve_model",
    "served_name_of",
]
