"""The embedded default model is built offline and byte-for-byte reproducibly."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.tiny_model import (
    TinyLlamaSpec,
    build_tiny_llama,
    embedded_model_path,
    folder_digest,
)


def test_two_builds_give_the_same_bytes(tmp_path: Path) -> None:
    spec = TinyLlamaSpec()
    build_tiny_llama(tmp_path / "a", spec)
    build_tiny_llama(tmp_path / "b", spec)
    assert folder_digest(tmp_path / "a") == folder_digest(tmp_path / "b")


def test_another_seed_gives_other_weights(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path / "a", TinyLlamaSpec(seed=0))
    build_tiny_llama(tmp_path / "b", TinyLlamaSpec(seed=1))
    weights_a = (tmp_path / "a" / "model.safetensors").read_bytes()
    weights_b = (tmp_path / "b" / "model.safetensors").read_bytes()
    assert weights_a != weights_b


def test_cache_folder_is_built_once_and_overridable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    first = embedded_model_path()
    assert first.parent == tmp_path
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert embedded_model_path() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_tokenizer_is_byte_level_with_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    build_tiny_llama(tmp_path, TinyLlamaSpec())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo, wörld ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == TinyLlamaSpec().vocab_size
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(chat, str)  # tokenize=False: the text
    assert chat.startswith(tokenizer.bos_token)
    assert chat.endswith("<|assistant|>\n")
