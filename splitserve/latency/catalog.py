"""The devices and models splitserve simulates: their published specs, the efficiency
factors a real vLLM engine reaches on each device, and the latency profiles built from
them (splitserve/latency/roofline.py).

Every number names where it comes from (``sources``). The efficiency factors come from
public measurements, not guesses, where one exists:

- ``memory`` and ``compute``: Vidur's per-operator profiles of Llama layers on A100
  and H100 (github.com/microsoft/vidur, data/profiling/compute/...): the four GEMMs of
  one layer at 1 token (a pure weight read) and the GEMMs plus the layer's elementwise
  kernels at 2048 tokens (the roofline has no other term for those, so ``compute``
  carries them);
- ``step_overhead_s``: the residual of a published batch-1 decode step of vLLM
  (LambdaLabsML/vllm-benchmark, vLLM 0.6.0) once the roofline's weight and KV reads
  are taken off; it is computed below from that figure, not typed in;
- ``link_latency_s``: likewise, the residual of the published TP=2 step over the TP=1
  one, per all-reduce;
- the rest (the link's share of NVLink, attention's share of peak) from Vidur's NCCL
  profiles and the FlashAttention papers.

Other public figures are kept apart to check the profiles against
(tests/splitserve/test_latency_catalog.py); for the RTX 2080 SUPER no vLLM measurement
was found, so its factors are transferred from the A100/H100 ones and a Turing
llama.cpp measurement, and the study this project reproduces
(shared/reference/000_7aab1bec36634d9d.txt) is used only to validate.

``python -m splitserve.latency.catalog`` writes the shipped profiles.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import NamedTuple

import yaml
from pydantic import Field

from splitserve.config_base import StrictModel
from splitserve.latency.profile import LatencyProfile, StepShape
from splitserve.latency.roofline import GIB, DeviceSpec, Efficiency, ModelDims, roofline_profile

MIB = 1024**2
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


# --- The host path: PCIe, pinned copies, Ray's object store -------------------------


def pcie_bytes_per_s(generation: int, lanes: int) -> float:
    """One direction of a PCIe link: the lane rate after 128b/130b encoding."""
    gigatransfers = {3: 8.0, 4: 16.0, 5: 32.0}[generation]
    return gigatransfers * 1e9 * lanes * (128 / 130) / 8


def in_series(*rates: float) -> float:
    """The rate of stages that a transfer passes one after another."""
    return 1 / sum(1 / rate for rate in rates)


# Pinned cudaMemcpy reached 50.4-51.6 GiB/s each way over PCIe Gen5 x16 (63.0 GB/s) on
# H100 and H200 (docs/DECISIONS.md, bench/kv_gpu_copy.py): 0.87 of the link.
PINNED_COPY_SHARE = 0.87
# The connector's own copies, against that pinned memcpy, at 8k tokens (same source):
# the gather into pinned memory (pack) 0.78-0.86, the load staged through pinned
# buffers from the object store's pageable memory (unpack) 0.75-0.80.
PACK_SHARE = 0.82
UNPACK_SHARE = 0.78
# Ray's release microbenchmark, single_client_put_gigabytes: 19.86 GB/s
# (ray-project/ray release/perf_metrics/microbenchmark.json).
RAY_PUT_BYTES_PER_S = 19.86e9
HOST_PATH_SOURCES = [
    "KV hand-over = device->pinned host (pack) -> ray.put -> staged host->device (unpack),"
    " in series: pinned memcpy 0.87 of PCIe (docs/DECISIONS.md, bench/kv_gpu_copy.py on"
    " H100/H200), pack 0.82 and unpack 0.78 of pinned (same), ray.put 19.86 GB/s"
    " (ray-project/ray release/perf_metrics/microbenchmark.json)",
]


def host_path_bytes_per_s(pcie: float) -> float:
    """A KV hand-over between two engines through host memory and Ray's object store."""
    pinned = pcie * PINNED_COPY_SHARE
    return in_series(pinned * PACK_SHARE, RAY_PUT_BYTES_PER_S, pinned * UNPACK_SHARE)


# --- Models: config.json on Hugging Face ---------------------------------------------

LLAMA_3_2_1B = ModelDims(
    name="Llama-3.2-1B-Instruct",
    num_layers=16,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    tied_embeddings=True,
    sources=[
        "huggingface.co/meta-llama/Llama-3.2-1B-Instruct/blob/main/config.json"
        " (16 layers, hidden 2048, 32 heads, 8 KV heads, intermediate 8192,"
        " vocab 128256, tie_word_embeddings true)",
    ],
)
LLAMA_3_1_8B = ModelDims(
    name="Llama-3.1-8B",
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    sources=[
        "huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (32 layers,"
        " hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, untied)",
    ],
)
LLAMA_3_1_70B = ModelDims(
    name="Llama-3.1-70B",
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
    sources=[
        "huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (80 layers,"
        " hidden 8192, 64 heads, 8 KV heads, intermediate 28672, vocab 128256, untied)",
    ],
)

# Weights of the decoder layers in FP8 (per-tensor scales), the embeddings and LM head
# at BF16, the KV cache at BF16 (vLLM's kv_cache_dtype auto): the checkpoint Lambda's
# 70B FP8 runs served. vLLM multiplies it in FP8 where the device has FP8 tensor cores
# (H100) and widens the weights to BF16 as it reads them where not (A100: Marlin).
LLAMA_3_1_70B_FP8 = LLAMA_3_1_70B.model_copy(
    update={
        "name": "Llama-3.1-70B-FP8",
        "layer_weight_bytes": 1,
        "sources": [
            *LLAMA_3_1_70B.sources,
            "huggingface.co/neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8: weights and"
            " activations of the linear layers in FP8 (static per-tensor scales);"
            " embeddings and lm_head unquantized",
        ],
    }
)


# --- Public measurements that calibrate a factor --------------------------------------


class Measurement(NamedTuple):
    """One engine step somebody published: its time and what it computed."""

    seconds: float
    step: StepShape
    source: str


def decode_step(seqs: int, context_tokens: int) -> StepShape:
    """``seqs`` decode requests with ``context_tokens`` of KV each."""
    return StepShape(decode_seqs=seqs, decode_context_tokens=seqs * context_tokens)


# LambdaLabsML/vllm-benchmark, results/prompt_10/<n>x<GPU>/Meta-Llama-3-8B-Instruct_*:
# vLLM 0.6.0 with 10 scheduler steps, so each streamed ITL spans 10 tokens. After the
# other nine requests end, request 6 (29 prompt tokens, 741 output) decodes alone: the
# batch-1 step is a tenth of those ITLs, at about 620 tokens of context.
LAMBDA = "github.com/LambdaLabsML/vllm-benchmark results/prompt_10"
LAMBDA_CONTEXT = 620
H100_8B_TP1 = Measurement(
    7.05e-3,
    decode_step(1, LAMBDA_CONTEXT),
    f"{LAMBDA}/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json: batch-1 ITL"
    " 70.3-70.9 ms per 10 tokens (vLLM 0.6.0)",
)
H100_8B_TP2 = Measurement(
    4.90e-3,
    decode_step(1, LAMBDA_CONTEXT),
    f"{LAMBDA}/2xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp2_len2048.json: batch-1 ITL"
    " 48.8-49.4 ms per 10 tokens",
)
A100_8B_TP1 = Measurement(
    11.4e-3,
    decode_step(1, LAMBDA_CONTEXT),
    f"{LAMBDA}/1xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json: batch-1 ITL"
    " 113.4-114.8 ms per 10 tokens",
)
A100_8B_TP2 = Measurement(
    7.2e-3,
    decode_step(1, LAMBDA_CONTEXT),
    f"{LAMBDA}/2xA100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp2_len2048.json: batch-1 ITL"
    " 71.9-72.3 ms per 10 tokens",
)


def _without_fixed_costs(efficiency: Efficiency) -> Efficiency:
    return efficiency.model_copy(update={"step_overhead_s": 0.0})


def _residual(profile: LatencyProfile, measured: Measurement) -> float:
    """What the measurement took beyond what the profile predicts; it must be some."""
    residual = measured.seconds - profile.step_seconds(measured.step)
    if residual <= 0:
        raise ValueError(f"the roofline already exceeds {measured.source}")
    return round(residual, 7)


def calibrated_overhead(
    device: DeviceSpec, model: ModelDims, efficiency: Efficiency, measured: Measurement
) -> Efficiency:
    """``efficiency`` whose step overhead is what a TP=1 measurement leaves over."""
    bare = roofline_profile(device, model, _without_fixed_costs(efficiency))
    overhead = _residual(bare, measured)
    sources = [
        *efficiency.sources,
        f"step_overhead_s {overhead * 1e3:.2f} ms = {measured.source} less the roofline",
    ]
    return efficiency.model_copy(update={"step_overhead_s": overhead, "sources": sources})


def calibrated_link_latency(
    device: DeviceSpec,
    model: ModelDims,
    efficiency: Efficiency,
    tensor_parallel_size: int,
    measured: Measurement,
) -> DeviceSpec:
    """``device`` whose per-all-reduce latency is what a TP measurement leaves over."""
    bare = roofline_profile(
        device.model_copy(update={"link_latency_s": 0.0}), model, efficiency, tensor_parallel_size
    )
    all_reduces = 2 * model.num_layers
    latency = round(_residual(bare, measured) / all_reduces, 8)
    sources = [
        *device.sources,
        f"link_latency_s {latency * 1e6:.1f} us per all-reduce = {measured.source} less the"
        f" roofline, over its {all_reduces} all-reduces",
    ]
    return device.model_copy(update={"link_latency_s": latency, "sources": sources})


# --- H100 SXM5 80GB -------------------------------------------------------------------

VIDUR = "github.com/microsoft/vidur data/profiling"
_H100_PUBLISHED = DeviceSpec(
    name="H100-SXM5-80GB",
    # nvidia-smi shows 81559 MiB for the 80 GB HBM3 part.
    memory_bytes=81559 * MIB,
    memory_bytes_per_s=3.35e12,
    flops_per_s=989.4e12,  # dense BF16 (1,979 TFLOPS is with sparsity)
    fp8_flops_per_s=1978.9e12,  # dense FP8 (3,958 TFLOPS is with sparsity)
    link_bytes_per_s=450e9,  # NVLink 4: 900 GB/s per GPU, both directions together
    link_latency_s=0.0,  # calibrated below
    handover_bytes_per_s=host_path_bytes_per_s(pcie_bytes_per_s(5, 16)),
    sources=[
        "nvidia.com/en-us/data-center/h100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s,"
        " BF16 1,979 TFLOPS with sparsity (989.4 dense), FP8 3,958 with sparsity"
        " (1,978.9 dense), NVLink 900 GB/s, PCIe Gen5",
        "KV hand-over over PCIe Gen5 x16 (63.0 GB/s a direction)",
        *HOST_PATH_SOURCES,
    ],
)
_H100_FACTORS = Efficiency(
    memory=0.77,
    compute=0.66,
    attention=0.5,
    link=0.55,
    step_overhead_s=0.0,  # calibrated below
    sources=[
        f"memory 0.77: {VIDUR}/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv, TP1,"
        " 1 token: one layer's 4 GEMMs in 0.156 ms = 0.77 of 3.35 TB/s",
        "compute 0.66: same file, 2048 tokens: GEMMs 1.087 ms + elementwise 0.179 ms"
        " per layer = 0.66 of 989 TFLOP/s (GEMMs alone 0.77)",
        "attention 0.5: FlashAttention-3 (arXiv:2407.08608), H100 BF16 forward, causal,"
        " head dim 128, ~0.5 of peak at 2k tokens",
        f"link 0.55: {VIDUR}/network/h100_dgx/all_reduce.csv, 16 MiB: bus bandwidth"
        " 227 GB/s (2 GPUs) to 255 GB/s (8) of NVLink's 450",
    ],
)


# --- A100 SXM4 80GB -------------------------------------------------------------------

_A100_PUBLISHED = DeviceSpec(
    name="A100-SXM4-80GB",
    memory_bytes=81920 * MIB,  # nvidia-smi: 81920 MiB
    memory_bytes_per_s=2.039e12,
    flops_per_s=312e12,  # dense BF16
    link_bytes_per_s=300e9,  # NVLink 3: 600 GB/s per GPU, both directions together
    link_latency_s=0.0,  # calibrated below
    handover_bytes_per_s=host_path_bytes_per_s(pcie_bytes_per_s(4, 16)),
    sources=[
        "nvidia.com/en-us/data-center/a100 datasheet, A100 80GB SXM: 2,039 GB/s,"
        " BF16 312 TFLOPS dense, NVLink 600 GB/s, PCIe Gen4",
        "KV hand-over over PCIe Gen4 x16 (31.5 GB/s a direction)",
        *HOST_PATH_SOURCES,
    ],
)
_A100_FACTORS = Efficiency(
    memory=0.775,
    compute=0.65,
    attention=0.6,
    link=0.38,
    step_overhead_s=0.0,  # calibrated below
    sources=[
        f"memory 0.775: {VIDUR}/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv, TP1,"
        " 1 token: one layer's 4 GEMMs in 0.276 ms = 0.775 of 2.039 TB/s",
        "compute 0.65: same file, GEMMs + elementwise per layer at 2048-4096 tokens ="
        " 0.646-0.671 of 312 TFLOP/s (GEMMs alone 0.70-0.73)",
        "attention 0.6: FlashAttention-2 (arXiv:2307.08691), A100 forward, causal,"
        " head dim 128, ~0.6 of peak",
        f"link 0.38: {VIDUR}/network/a100_dgx/all_reduce.csv, 16 MiB: bus bandwidth"
        " 107 GB/s (8 GPUs) to 121 GB/s (2) of NVLink's 300",
    ],
)
# --- What the engine's host pays, fitted on public runs ------------------------------


class HostTerms(StrictModel):
    """A device's terms beside the roofline's, fitted on public runs of vLLM on it
    (bench/fit_published.py writes them, with the runs it fitted on and the error on the
    runs it held out, into public_runs/fitted.yaml)."""

    request_overhead_s: float = Field(0.0, ge=0)
    per_sequence_s: float = Field(0.0, ge=0)
    quantized_layer_s: float = Field(0.0, ge=0)
    quantized_compute: float = Field(1.0, gt=0, le=1)
    vllm_version: str | None = None
    calibration_runs: list[str] = Field(default_factory=list)
    held_out_runs: list[str] = Field(default_factory=list)
    held_out_error: dict[str, float] = Field(default_factory=dict)
    calibration_error: dict[str, float] = Field(default_factory=dict)

    def applied_to(self, efficiency: Efficiency) -> Efficiency:
        sources = efficiency.sources
        if self.calibration_runs:  # a fit's result, not a candidate: say where from
            sources = [
                *sources,
                f"request_overhead_s {self.request_overhead_s * 1e3:.2f} ms, per_sequence_s"
                f" {self.per_sequence_s * 1e6:.1f} us, quantized_layer_s"
                f" {self.quantized_layer_s * 1e6:.1f} us, quantized_compute"
                f" {self.quantized_compute:.3f}: fitted on vLLM {self.vllm_version}'s"
                f" public runs {', '.join(self.calibration_runs)} (bench/fit_published.py;"
                " splitserve/latency/public_runs)",
            ]
        return efficiency.model_copy(
            update={
                "request_overhead_s": self.request_overhead_s,
                "per_sequence_s": self.per_sequence_s,
                "quantized_layer_s": self.quantized_layer_s,
                "quantized_compute": self.quantized_compute,
                "sources": sources,
            }
        )


def fitted_host_terms() -> dict[str, HostTerms]:
    """public_runs/fitted.yaml, by device; none where it is absent (before a first fit)."""
    path = FITTED_PATH
    if not path.exists():
        return {}
    document = yaml.safe_load(path.read_text()) or {}
    return {
        device: HostTerms.model_validate(terms)
        for device, terms in (document.get("devices") or {}).items()
    }


FITTED_PATH = Path(__file__).resolve().parent / "public_runs" / "fitted.yaml"
FITTED = fitted_host_terms()


def calibrated_device(
    published: DeviceSpec,
    factors: Efficiency,
    tp1: Measurement,
    tp2: Measurement,
    host: HostTerms,
) -> tuple[DeviceSpec, Efficiency]:
    """A device whose step overhead and all-reduce latency are what its published
    batch-1 steps leave over once the roofline and ``host``'s terms are taken off."""
    efficiency = calibrated_overhead(published, LLAMA_3_1_8B, host.applied_to(factors), tp1)
    return calibrated_link_latency(published, LLAMA_3_1_8B, efficiency, 2, tp2), efficiency


def _h100(host: HostTerms) -> tuple[DeviceSpec, Efficiency]:
    return calibrated_device(_H100_PUBLISHED, _H100_FACTORS, H100_8B_TP1, H100_8B_TP2, host)


def _a100(host: HostTerms) -> tuple[DeviceSpec, Efficiency]:
    return calibrated_device(_A100_PUBLISHED, _A100_FACTORS, A100_8B_TP1, A100_8B_TP2, host)


CALIBRATED: dict[str, Callable[[HostTerms], tuple[DeviceSpec, Efficiency]]] = {
    "h100": _h100,
    "a100": _a100,
}
H100_SXM_80GB, H100_EFFICIENCY = _h100(FITTED.get("h100", HostTerms()))
A100_SXM_80GB, A100_EFFICIENCY = _a100(FITTED.get("a100", HostTerms()))


# --- RTX 2080 SUPER 8GB, as in the study: PCIe Gen3 x8, no peer-to-peer ---------------

_STUDY = "shared/reference/000_7aab1bec36634d9d.txt (2x RTX 2080 SUPER, vLLM 0.16.0)"
# The study's GPUs sit on PCIe Gen3 x8 (section 3.1), not the card's x16.
_RTX_2080S_PCIE = pcie_bytes_per_s(3, 8)
RTX_2080_SUPER = DeviceSpec(
    name="RTX-2080-SUPER-8GB",
    memory_bytes=8 * GIB,
    memory_bytes_per_s=496e9,
    # 48 SMs x 8 tensor cores x 64 FMA x 2 x 1.815 GHz = 89.2 TFLOPS FP16 with FP16
    # accumulate; GeForce Turing runs FP32 accumulate (cuBLAS's, vLLM's) at half rate.
    flops_per_s=44.6e12,
    # No peer-to-peer: NCCL's all-reduce goes device -> host -> device over PCIe.
    link_bytes_per_s=_RTX_2080S_PCIE * PINNED_COPY_SHARE,
    # NCCL over shared host memory: 2x RTX 4090 with P2P disabled ran an 8-byte
    # collective in ~12 us (github.com/tinygrad/open-gpu-kernel-modules issue 17);
    # an all-reduce is two ring steps, on an older PCIe Gen3 host.
    link_latency_s=20e-6,
    handover_bytes_per_s=host_path_bytes_per_s(_RTX_2080S_PCIE),
    sources=[
        "nvidia.com GeForce RTX 2080 SUPER specs: 8 GB GDDR6 256-bit at 15.5 Gbps"
        " = 496 GB/s, 3072 CUDA cores (48 SMs), 1815 MHz boost, PCIe 3.0 x16 card",
        "NVIDIA Turing architecture whitepaper: 8 tensor cores per SM, 64 FP16 FMA each"
        " per clock; GeForce parts run FP16 with FP32 accumulate at half rate -> 44.6"
        " TFLOPS",
        f"{_STUDY}: PCIe Gen3 x8, peer access unsupported, KV moved through the host",
        "TP all-reduce over PCIe Gen3 x8 (7.88 GB/s a direction) through host memory;"
        " latency 20 us from a no-P2P NCCL collective of ~12 us"
        " (github.com/tinygrad/open-gpu-kernel-modules issue 17)",
        *HOST_PATH_SOURCES,
    ],
)
# Vidur's A100 Llama-3-8B profile: one layer's elementwise kernels (norms, RoPE, SiLU,
# adds) at 1 token take 27 us; the A100 step overhead covers 32 such layers.
VIDUR_ELEMENTWISE_PER_LAYER_S = 27e-6
RTX_2080_SUPER_EFFICIENCY = Efficiency(
    memory=0.78,
    compute=0.65,
    attention=0.3,
    link=0.5,
    # The A100's calibrated overhead, less the per-layer kernels of the 16 layers that
    # Llama-3.2-1B lacks against the 8B it was calibrated on.
    step_overhead_s=round(
        A100_EFFICIENCY.step_overhead_s
        - (LLAMA_3_1_8B.num_layers - LLAMA_3_2_1B.num_layers) * VIDUR_ELEMENTWISE_PER_LAYER_S,
        7,
    ),
    # An 8 GB card: activations and CUDA graphs of a 1B model (estimate; vLLM's
    # profile run of Llama-3.2-1B on this card was not published).
    reserved_bytes=1 * GIB,
    sources=[
        "memory 0.78: RTX 2080 (TU104, 448 GB/s) ran Llama-3.1-8B Q4_K_M (4.92 GB) at"
        " 71.9 tok/s in llama.cpp (github.com/AlexsJones/llmfit PR 773): 0.74-0.79 of"
        " peak end to end; the A100/H100 GEMM reads reach 0.77-0.775 (Vidur)",
        "compute 0.65: no Turing GEMM profile found; A100's and H100's measured share"
        " (Vidur, GEMMs + elementwise at 2048 tokens) carried over",
        "attention 0.3: assumption; FlashAttention-2 does not run on Turing (sm75), and"
        " vLLM falls back to slower kernels",
        "link 0.5: assumption; NCCL's shared-memory transport stages each chunk through"
        " host memory",
        f"step_overhead_s: A100's calibrated overhead less 16 x 27 us of per-layer"
        f" elementwise kernels ({VIDUR}/compute/a100/meta-llama/Meta-Llama-3-8B/mlp.csv)",
        "reserved_bytes 1 GiB: estimate for a 1B model's activations and CUDA graphs",
        f"validated only (not calibrated) against {_STUDY}",
    ],
)


# --- Lookup by short name ----------------------------------------------------------------

DEVICES: dict[str, tuple[DeviceSpec, Efficiency]] = {
    "rtx2080s": (RTX_2080_SUPER, RTX_2080_SUPER_EFFICIENCY),
    "a100": (A100_SXM_80GB, A100_EFFICIENCY),
    "h100": (H100_SXM_80GB, H100_EFFICIENCY),
}
MODELS: dict[str, ModelDims] = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
    "llama-3.1-70b": LLAMA_3_1_70B,
    "llama-3.1-70b-fp8": LLAMA_3_1_70B_FP8,
}


def _known(kind: str, name: str, known: Collection[str]) -> None:
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}")


# vLLM's scheduler defaults for an OpenAI server on each device: 8192 batched tokens and
# 1024 sequences on a GPU of 70 GiB or more that is not an A100, else 2048 and 256
# (EngineArgs.get_batch_defaults, vllm/engine/arg_utils.py, vLLM 0.32.0).
VLLM_BATCH_DEFAULTS: dict[str, tuple[int, int]] = {
    "rtx2080s": (2048, 256),
    "a100": (2048, 256),
    "h100": (8192, 1024),
}


def catalog_profile(
    device: str,
    model: str,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    host: HostTerms | None = None,
) -> LatencyProfile:
    """The profile of ``model`` on ``tensor_parallel_size x pipeline_parallel_size``
    devices of the type ``device``, by short name (``"h100"``, ``"llama-3.1-8b"``).
    ``host``: host terms to build it with instead of the fitted ones (a fit's candidate)."""
    _known("device", device, DEVICES)
    _known("model", model, MODELS)
    spec, efficiency = DEVICES[device]
    if host is not None and device in CALIBRATED:
        spec, efficiency = CALIBRATED[device](host)
    terms = host if host is not None else FITTED.get(device, HostTerms())
    profile = roofline_profile(
        spec, MODELS[model], efficiency, tensor_parallel_size, pipeline_parallel_size
    )
    batched_tokens, seqs = VLLM_BATCH_DEFAULTS[device]
    return profile.model_copy(
        update={
            "max_num_batched_tokens": batched_tokens,
            "max_num_seqs": seqs,
            "source": f"{profile.source}; vLLM 0.32.0 batch defaults on this device:"
            f" {batched_tokens} tokens, {seqs} sequences (EngineArgs.get_batch_defaults)",
            "vllm_version": terms.vllm_version,
            "calibration_runs": terms.calibration_runs,
            "held_out_runs": terms.held_out_runs,
            "held_out_error": terms.held_out_error,
        }
    )


def profile_name(
    device: str, model: str, tensor_parallel_size: int, pipeline_parallel_size: int
) -> str:
    return f"{device}-{model}-tp{tensor_parallel_size}-pp{pipeline_parallel_size}"


# (device, model, TP, PP) of the profiles that ship: the study's setups, and the usual
# H100/A100 ones. 70B at bf16 needs at least two 80 GB devices.
SHIPPED: tuple[tuple[str, str, int, int], ...] = (
    ("rtx2080s", "llama-3.2-1b", 1, 1),
    ("rtx2080s", "llama-3.2-1b", 2, 1),
    ("rtx2080s", "llama-3.2-1b", 1, 2),
    *((gpu, "llama-3.1-8b", tp, 1) for gpu in ("h100", "a100") for tp in (1, 2, 4)),
    *(
        (gpu, "llama-3.1-70b", tp, pp)
        for gpu in ("h100", "a100")
        for tp, pp in ((4, 1), (8, 1), (4, 2))
    ),
    # FP8 70B fits two devices: the public runs of 70B at FP8 use 2, 4 and 8.
    *((gpu, "llama-3.1-70b-fp8", tp, 1) for gpu in ("h100", "a100") for tp in (2, 4, 8)),
)


def main(out_dir: Path = PROFILES_DIR) -> list[Path]:
    """Write the shipped profiles into ``out_dir``; a setup that does not fit is skipped."""
    written = []
    for device, model, tp, pp in SHIPPED:
        try:
            profile = catalog_profile(device, model, tp, pp)
        except ValueError as error:
            print(f"skipped {profile_name(device, model, tp, pp)}: {error}", file=sys.stderr)
            continue
        path = out_dir / f"{profile_name(device, model, tp, pp)}.yaml"
        profile.save(path)
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in main():
        print(written_path)
