"""The handle a prefill engine returns and a decode engine consumes, and the layout check.

The handle travels in ``kv_transfer_params``: out of the prefill engine's
``RequestOutput`` and into the decode request's ``SamplingParams.extra_args``. The
router passes it on unchanged; only this package reads it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from splitserve.config_base import StrictModel

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Our fields live under one key, so they never collide with vLLM's own.
PARAMS_KEY = "splitserve_kv"
HANDLE_VERSION = 1
# In a prefill request's kv_transfer_params: the decode engine that will load the KV.
CONSUMER_KEY = "splitserve_consumer"


class KVLayoutMismatchError(ValueError):
    """The prefill and decode engines do not store KV the same way; loading would be wrong."""


class LayoutFingerprint(StrictModel):
    """Everything that must be equal on both sides for KV blocks to mean the same thing."""

    model: str
    kv_dtype: str
    block_size: int
    num_layers: int
    kv_heads_per_rank: int
    head_size: int
    tp_size: int
    pp_size: int

    def differences(self, other: LayoutFingerprint) -> list[str]:
        mine, theirs = self.model_dump(), other.model_dump()
        differing = [key for key in mine if mine[key] != theirs[key]]
        return [f"{key} {mine[key]!r} != {theirs[key]!r}" for key in differing]


def layout_fingerprint(vllm_config: VllmConfig) -> LayoutFingerprint:
    """This engine's layout, computable anywhere the VllmConfig is (front end or engine)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = str(model.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    return LayoutFingerprint(
        model=model.model,
        kv_dtype=kv_dtype,
        block_size=vllm_config.cache_config.block_size,
        num_layers=model.get_num_layers(parallel),
        kv_heads_per_rank=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
    )


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Identifies the prompt whose KV a transfer holds, so it is never loaded for another."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


class TransferHandle(StrictModel):
    """Names one request's KV in the object store: one part per producer worker rank."""

    transfer_id: str
    producer: str
    namespace: str
    num_tokens: int
    prompt_digest: str
    num_parts: int
    layout: LayoutFingerprint
    expires_at: float  # wall-clock time after which the directory frees the objects
    # The decode engine the parts were pushed to, if the router named one; that engine
    # waits for the push instead of claiming, any other claims.
    consumer: str | None = None

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` to hand to the decode engine as they are."""
        fields = {**self.model_dump(), "version": HANDLE_VERSION}
        return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: fields}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> TransferHandle:
        """Parse our handle; ValueError (never anything else) if it is not a valid one."""
        fields = params.get(PARAMS_KEY)
        if not isinstance(fields, dict) or fields.get("version") != HANDLE_VERSION:
            raise ValueError(f"kv_transfer_params carry no version-{HANDLE_VERSION} handle")
        try:
            return cls.model_validate({k: v for k, v in fields.items() if k != "version"})
        except ValidationError as error:
            raise ValueError(f"malformed KV transfer handle: {error}") from error


def remote_decode_params(consumer: str | None = None) -> dict[str, Any]:
    """A prefill request's ``kv_transfer_params``: compute the prompt, keep its KV.

    ``consumer``: ``consumer_id`` of the decode engine that will load it; its ranks then
    receive the parts ahead of the decode request instead of asking for them.
    """
    params: dict[str, Any] = {"do_remote_decode": True}
    if consumer:
        params[CONSUMER_KEY] = consumer
    return params


def remote_prefill_params(handle: dict[str, Any] | None) -> dict[str, Any]:
    """A decode request's ``kv_transfer_params``: load the KV ``handle`` names (a prefill's
    output), compute only what it lacks."""
    return {"do_remote_prefill": True, **(handle or {})}


def consumer_id(vllm_config: VllmConfig) -> str | None:
    """How a prefill request names this engine as its KV's consumer (None: not one)."""
    transfer_config = vllm_config.kv_transfer_config
    if transfer_config is None or not transfer_config.is_kv_consumer:
        return None
    return str(transfer_config.engine_id)


def is_transfer_params(params: dict[str, Any] | None) -> bool:
    return bool(params) and PARAMS_KEY in params  # type: ignore[operator]


def check_layout(handle: TransferHandle, consumer: LayoutFingerprint) -> None:
    """Raise KVLayoutMismatchError naming every field that differs."""
    differences = handle.layout.differences(consumer)
    if differences:
        raise KVLayoutMismatchError(
            f"KV transfer {handle.transfer_id} from engine {handle.producer} cannot be "
            f"loaded here, the KV layouts differ (prefill != decode): {'; '.join(differences)}"
        )


def check_handle_compatible(params: dict[str, Any], vllm_config: VllmConfig) -> None:
    """For the decode engine's host, before it submits: refuse a handle it cannot load."""
    check_layout(TransferHandle.from_params(params), layout_fingerprint(vllm_config))
