"""Turn the ``model.source`` of a config into something vLLM and a tokenizer can load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.settings import ModelConfig
from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path

EMBEDDED_SOURCE = "embedded"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # a local folder or a Hugging Face id
    served_name: str


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Build the embedded model if asked for; pass local folders and hub ids through."""
    if config.source == EMBEDDED_SOURCE:
        path = str(embedded_model_path())
        default_name = EMBEDDED_MODEL_NAME
    else:
        local = Path(config.source).expanduser()
        path = str(local.resolve()) if local.exists() else config.source
        default_name = config.source
    return ResolvedModel(path=path, served_name=config.served_model_name or default_name)
