"""The embedded default model: a tiny Llama built locally and deterministically.

It has random weights from a fixed seed and a byte-level tokenizer, so the whole
stack (engines, KV transfer, routing, load generation) runs offline. The folder is
built once into a cache and reused; building twice gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pydantic import BaseModel

EMBEDDED_MODEL_NAME = "splitserve-tiny-llama"
CACHE_ENV_VAR = "SPLITSERVE_CACHE_DIR"
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
NUM_BYTE_TOKENS = 256
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TinyLlamaSpec(BaseModel, frozen=True):
    """Shape of the embedded model; small enough for two CPU cores, with enough heads for TP=2."""

    seed: int = 0
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    init_std: float = 0.02

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "splitserve"


def embedded_model_path(spec: TinyLlamaSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Folder of the embedded model, building it on first use."""
    spec = spec or TinyLlamaSpec()
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / f"{EMBEDDED_MODEL_NAME}-{spec.fingerprint()}"
    if (target / "config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent builders never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        build_tiny_llama(staging, spec)
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_llama(folder: Path, spec: TinyLlamaSpec) -> None:
    """Write config, weights and tokenizer of the tiny Llama into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_weights(folder, spec)
    _write_tokenizer(folder, spec)


def _write_weights(folder: Path, spec: TinyLlamaSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=_bos_id(),
        eos_token_id=_eos_id(),
        tie_word_embeddings=False,
        # A PretrainedConfig keyword (its **kwargs), written to config.json for vLLM.
        torch_dtype="float32",  # type: ignore[call-arg]
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Fill every tensor from our own generator, in name order, so the weights do not
    # depend on how a transformers release initialises modules.
    generator = torch.Generator().manual_seed(spec.seed)
    state = {}
    for name, param in sorted(model.state_dict().items()):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(param.shape)
        else:
            state[name] = torch.randn(param.shape, generator=generator) * spec.init_std
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=False)
    model.save_pretrained(folder, safe_serialization=True)
    _strip_unstable_config_fields(folder / "config.json")
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        _strip_unstable_config_fields(generation_config)


def _strip_unstable_config_fields(path: Path) -> None:
    # transformers writes its own version; keep the files identical across releases.
    data = json.loads(path.read_text())
    data.pop("transformers_version", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _bos_id() -> int:
    return NUM_BYTE_TOKENS


def _eos_id() -> int:
    return NUM_BYTE_TOKENS + 1


def _write_tokenizer(folder: Path, spec: TinyLlamaSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_symbol)
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Every id the model can emit decodes to something: bytes, bos/eos, then reserved ids.
    reserved = [f"<|reserved_{i}|>" for i in range(spec.vocab_size - NUM_BYTE_TOKENS - 2)]
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN, *reserved])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.exists():
            _strip_unstable_config_fields(path)


def _byte_of_symbol(symbol: str) -> int:
    return _BYTE_OF_SYMBOL[symbol]


def _byte_symbol_table() -> dict[str, int]:
    # GPT-2's byte-to-unicode map: printable bytes map to themselves, the rest above 255.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[str, int] = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_OF_SYMBOL = _byte_symbol_table()


def folder_digest(folder: Path) -> str:
    """One hash over every file's name and bytes, to prove a build is reproducible."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
