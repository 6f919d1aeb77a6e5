"""Latency profiles from a roofline: a device's published memory bandwidth, arithmetic
rate and link, a model's published shape, and named efficiency factors for the share of
each peak a real engine reaches.

A step's linear layers read every weight once (memory-bound at small batches) and do two
FLOPs per weight per token (compute-bound at large ones); decode attention reads each
context token's KV; prefill attention does four FLOPs per hidden unit per query-key pair
per layer. TP divides weights, KV and arithmetic by its degree and adds two all-reduces
per layer; PP divides them by its degree per stage, runs the stages one after another for
a batch, and adds a hand-off between stages.
"""

from __future__ import annotations

from pydantic import Field

from splitserve.config_base import StrictModel
from splitserve.latency.profile import LatencyProfile

GIB = 1024**3


class DeviceSpec(StrictModel):
    """One accelerator's published peaks."""

    name: str
    memory_bytes: float = Field(gt=0)
    memory_bytes_per_s: float = Field(gt=0, description="HBM/GDDR bandwidth.")
    flops_per_s: float = Field(gt=0, description="Dense 16-bit tensor arithmetic.")
    fp8_flops_per_s: float | None = Field(
        None,
        gt=0,
        description="Dense FP8 tensor arithmetic; None where the device has none (an FP8"
        " checkpoint then multiplies at 16 bits, its weights widened as they are read).",
    )
    # Between two devices of a TP group (NVLink, or PCIe where there is none).
    link_bytes_per_s: float = Field(gt=0)
    link_latency_s: float = Field(ge=0)
    # A KV hand-over between engines on two devices (PD): the host path through pinned
    # memory (device → host → object store → host → device) where peer-to-peer is absent.
    handover_bytes_per_s: float = Field(gt=0)
    # The hand-over's fixed cost: the prefill rank's put, the directory's push, the
    # decode rank's get, each a round trip of Ray's control path.
    handover_latency_s: float = Field(1e-3, ge=0)
    sources: list[str] = Field(min_length=1)


class ModelDims(StrictModel):
    """A decoder-only transformer's published shape."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tied_embeddings: bool = False
    dtype_bytes: int = Field(2, gt=0, description="Activations and KV cache.")
    layer_weight_bytes: int | None = Field(
        None,
        gt=0,
        description="Per weight of the decoder layers, where a quantized checkpoint's"
        " differ (FP8: 1); its embeddings and LM head keep dtype_bytes, as the FP8"
        " checkpoints vLLM serves keep them.",
    )
    sources: list[str] = Field(min_length=1)

    @property
    def layer_bytes_per_weight(self) -> int:
        return self.layer_weight_bytes or self.dtype_bytes

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        """What the weights take in memory."""
        layers = self.num_layers * self.layer_params * self.layer_bytes_per_weight
        return layers + self.embedding_params * self.dtype_bytes

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        kv_width = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (2 * self.hidden_size + 2 * kv_width)
        mlp = 3 * self.hidden_size * self.intermediate_size  # gate, up, down (SwiGLU)
        return attention + mlp

    @property
    def params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies: the layers and the LM head (the input
        embedding is a lookup)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim * self.dtype_bytes


class Efficiency(StrictModel):
    """The share of each published peak an engine reaches: named, so that a profile
    says what it assumed, and refined where measurements exist."""

    memory: float = Field(gt=0, le=1, description="Of peak bandwidth, reading weights and KV.")
    compute: float = Field(gt=0, le=1, description="Of peak dense FLOPs, in the linear layers.")
    attention: float = Field(gt=0, le=1, description="Of peak FLOPs, in prefill attention.")
    link: float = Field(gt=0, le=1, description="Of the link's peak, in all-reduces.")
    step_overhead_s: float = Field(ge=0, description="Scheduling, launches, sampling per step.")
    # What the engine's host pays beside the device's work, fitted on public runs
    # (bench/fit_published.py; splitserve/latency/public_runs/fitted.yaml).
    request_overhead_s: float = Field(
        0.0, ge=0, description="The front end's input processing of one request."
    )
    per_sequence_s: float = Field(
        0.0, ge=0, description="Per request in a step: its inputs, sampling, its output."
    )
    quantized_layer_s: float = Field(
        0.0,
        ge=0,
        description="Per decoder layer and step of a quantized checkpoint: the kernels that"
        " quantize activations and scale outputs, which a 16-bit model does not run.",
    )
    quantized_compute: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Of ``compute``, what a quantized checkpoint's linear layers reach: its"
        " kernels (FP8 GEMMs with per-tensor scales; on a device without FP8 arithmetic,"
        " weights widened as they are read) reach less of their rate than 16-bit GEMMs.",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # Activations, CUDA graphs and the allocator's share, per device.
    reserved_bytes: float = Field(2 * GIB, ge=0)
    sources: list[str] = Field(default_factory=list)


def roofline_profile(
    device: DeviceSpec,
    model: ModelDims,
    efficiency: Efficiency,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> LatencyProfile:
    """The profile of ``model`` on ``tensor_parallel_size x pipeline_parallel_size``
    devices of one type."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    devices = tp * pp
    bandwidth = device.memory_bytes_per_s * efficiency.memory
    flops = device.flops_per_s * efficiency.compute
    layer_flops = flops
    if model.layer_bytes_per_weight == 1 and device.fp8_flops_per_s is not None:
        layer_flops = device.fp8_flops_per_s * efficiency.compute
    if model.layer_bytes_per_weight < model.dtype_bytes:
        layer_flops *= efficiency.quantized_compute
    # Per stage a device holds 1/devices of the weights and KV; PP's stages run in turn,
    # so a batch's step takes pp stage times: the sums below are over the whole model.
    weight_bytes = model.weight_bytes
    layer_weights = model.num_layers * model.layer_params
    # A step reads the weights it multiplies; the input embedding is only looked up.
    read_bytes = (
        layer_weights * model.layer_bytes_per_weight + model.lm_head_params * model.dtype_bytes
    )
    weights_read_s = read_bytes / tp / bandwidth
    compute_per_token_s = (2 * layer_weights / layer_flops + 2 * model.lm_head_params / flops) / tp
    per_context_token_s = model.kv_bytes_per_token / tp / bandwidth
    per_attention_pair_s = (
        4 * model.num_layers * model.hidden_size / tp / (device.flops_per_s * efficiency.attention)
    )
    serial_per_token_s = 0.0
    all_reduces = 0
    if tp > 1:
        # Ring all-reduce of each token's hidden state, twice per layer.
        all_reduces = 2 * model.num_layers
        ring_bytes = 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
        serial_per_token_s += all_reduces * ring_bytes / (device.link_bytes_per_s * efficiency.link)
    if pp > 1:
        hop_bytes = model.hidden_size * model.dtype_bytes
        serial_per_token_s += (pp - 1) * hop_bytes / (device.link_bytes_per_s * efficiency.link)
    fixed_s = efficiency.step_overhead_s + (all_reduces + pp - 1) * device.link_latency_s
    if model.layer_bytes_per_weight < model.dtype_bytes:
        fixed_s += model.num_layers * efficiency.quantized_layer_s
    free_per_device = (
        device.memory_bytes * efficiency.gpu_memory_utilization
        - weight_bytes / devices
        - efficiency.reserved_bytes
    )
    if free_per_device <= 0:
        raise ValueError(
            f"{model.name} does not fit {devices} x {device.name}: its weights take"
            f" {weight_bytes / devices / GIB:.1f} GiB of each device's"
            f" {device.memory_bytes * efficiency.gpu_memory_utilization / GIB:.1f} GiB"
        )
    kv_capacity_tokens = int(free_per_device * devices / model.kv_bytes_per_token)
    sources = [*device.sources, *model.sources, *efficiency.sources]
    return LatencyProfile(
        device=device.name,
        model=model.name,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        source="roofline of published specs: " + "; ".join(sources),
        step_overhead_s=fixed_s,
        request_overhead_s=efficiency.request_overhead_s,
        per_sequence_s=efficiency.per_sequence_s,
        weights_read_s=weights_read_s,
        compute_per_token_s=compute_per_token_s,
        serial_per_token_s=serial_per_token_s,
        per_context_token_s=per_context_token_s,
        per_attention_pair_s=per_attention_pair_s,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_capacity_tokens=kv_capacity_tokens,
        handover_bytes_per_s=device.handover_bytes_per_s,
        handover_latency_s=device.handover_latency_s,
    )
