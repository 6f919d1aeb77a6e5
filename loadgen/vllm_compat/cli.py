"""``vllm bench serve``'s command line, as ``python -m loadgen`` takes it (vLLM 0.32).

Every flag of vLLM's ``add_cli_args`` (tests/loadgen/vllm_compat/test_vllm_cli.py reads
the list from vLLM's own parser) is either served, with vLLM's meaning, or refused by
name with the reason: never ignored. Flags both tools have (``--model``, ``--seed``,
``--request-rate``, ``--num-prompts``, ``--max-concurrency``, ``--burstiness``,
``--temperature``, ``--result-dir``, ``--random-input-len`` ...) are the load
generator's own, listed in ``loadgen.cli.common``; this module adds the rest and turns
them into our configs.


Where the defaults differ, ours stay unless the flag is given: 200 requests (vLLM 1000),
2 warm-ups (vLLM 0), temperature 0 (vLLM: the server's default), no ``x-request-id``
unless ``--request-id-prefix`` (vLLM: always, with a random prefix).

This module must not import vLLM: the load generator is a client that runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loadgen.client.streaming import ENDPOINT_PATHS
from loadgen.config import (
    CUSTOM_WORKLOAD,
    DEFAULT_BASE_URL,
    PREFIX_REPETITION_WORKLOAD,
    PROMPT_FILE_WORKLOAD,
    RampUpConfig,
    WorkloadConfig,
)
from loadgen.vllm_compat.result import (
    PERCENTILE_METRICS,
    VLLM_DEFAULT_METRICS,
    VLLM_DEFAULT_PERCENTILES,
    VllmResultOptions,
)

SERVED_DATASETS = ("random", "burstgpt", "prefix_repetition", "custom")
VLLM_DATASETS = (
    "sharegpt", "burstgpt", "random", "random-mm", "random-rerank", "hf", "custom",
    "custom_audio", "custom_image", "prefix_repetition", "spec_bench", "speed_bench",
    "timed_trace",
)  # fmt: skip
SERVED_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
VLLM_BACKENDS = (
    "vllm", "openai", "openai-chat", "openai-responses", "openai-audio", "openai-embeddings",
    "openai-embeddings-chat", "openai-embeddings-clip", "openai-embeddings-vlm2vec",
    "infinity-embeddings", "infinity-embeddings-clip", "vllm-pooling", "vllm-rerank",
)  # fmt: skip
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# vLLM's defaults for its datasets' lengths (vllm/benchmarks/datasets/datasets.py).
RANDOM_LENGTHS = (1024, 128)
PREFIX_REPETITION_DEFAULTS = {"prefix_len": 256, "suffix_len": 256, "num_prefixes": 10}
PREFIX_REPETITION_OUTPUT_LEN = 128
CUSTOM_OUTPUT_LEN = 256
BURSTGPT_MODEL = "GPT-4"  # vLLM's BurstGPT dataset keeps only these rows

_DATASET_REASON = "a dataset python -m loadgen does not serve (served: " + (
    ", ".join(SERVED_DATASETS) + ")"
)
# Flags of vLLM's datasets (or benchmarks) that are not served, by dataset.
UNSERVED_DATASET_FLAGS: dict[str, tuple[str, ...]] = {
    "hf": ("--no-stream", "--hf-subset", "--hf-split", "--hf-name", "--hf-output-len",
           "--bfcl-categories", "--blazedit-min-distance", "--blazedit-max-distance",
           "--asr-max-audio-len-sec", "--asr-min-audio-len-sec"),
    "the multimodal datasets": ("--enable-multimodal-chat", "--custom-ensure-client-side-data",
                                "--random-mm-base-items-per-request",
                                "--random-mm-num-mm-items-range-ratio",
                                "--random-mm-limit-mm-per-prompt", "--random-mm-bucket-config"),
    "the embedding and rerank benchmarks": ("--random-batch-size", "--no-reranker"),
    "spec_bench": ("--spec-bench-output-len", "--spec-bench-category"),
    "speed_bench": ("--speed-bench-dataset-subset", "--speed-bench-output-len",
                    "--speed-bench-category"),
    "sharegpt": ("--sharegpt-output-len",),
    "timed_trace": ("--timed-trace-chunk-hash-size", "--timed-trace-sec-multiplier",
                    "--timed-trace-label-timestamp", "--timed-trace-label-input-length",
                    "--timed-trace-label-output-length", "--timed-trace-label-hash-ids",
                    "--self-timed", "--no-self-timed"),
}  # fmt: skip
# vLLM's flags that are refused, by name, and why.
REFUSED_FLAGS: dict[str, str] = {
    **{
        flag: f"an option of {dataset}, {_DATASET_REASON}"
        for dataset, flags in UNSERVED_DATASET_FLAGS.items()
        for flag in flags
    },
    "--use-beam-search": "vLLM 0.32's client does not use it either; refused, not ignored",
    "--probe-request-rate": "probe requests beside the load are not implemented",
    "--profile": "it drives vLLM's /start_profile, which the splitserve router does not have",
    "--chat-template-kwargs": "python -m loadgen loads no tokenizer to render templates with",
    "--skip-tokenizer-init": "python -m loadgen never loads a tokenizer; vLLM's flag also"
    " cuts the custom dataset to 1-token answers and drops TTFT/TPOT/ITL",
    "--plot-timeline": "vLLM's plotly timeline is not drawn; see the run's own <run>.png",
    "--timeline-itl-thresholds": "it colours vLLM's --plot-timeline, which is not drawn",
    "--plot-dataset-stats": "vLLM's dataset figure is not drawn; see the run's own <run>.png",
}
# Accepted, and said at run time to change nothing.
NO_EFFECT_FLAGS: dict[str, str] = {
    "--tokenizer-mode": "no tokenizer is loaded (prompts are token ids)",
    "--trust-remote-code": "no tokenizer or dataset code is loaded",
}


class RefusedFlag(argparse.Action):
    """A vLLM flag this load generator does not serve: naming it is an error."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")  # take its value, if any, to refuse it with the flag
        kwargs.setdefault("metavar", "VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        reason = REFUSED_FLAGS[option_string or self.option_strings[0]]
        raise argparse.ArgumentError(
            self, f"a flag of vllm bench serve that python -m loadgen does not serve: {reason}"
        )


def normalize_flag_names(argv: Sequence[str]) -> list[str]:
    """``--random_input_len=5`` -> ``--random-input-len=5``, as vLLM's parser allows."""
    normalized = []
    for token in argv:
        if token.startswith("--") and "_" in token.split("=", 1)[0]:
            name, equals, value = token.partition("=")
            token = name.replace("_", "-") + equals + value
        normalized.append(token)
    return normalized


def _choice(served: Sequence[str], known: Sequence[str], what: str) -> Any:
    def check(value: str) -> str:
        if value in served:
            return value
        if value in known:
            raise argparse.ArgumentTypeError(
                f"{value} is a {what} of vllm bench serve that python -m loadgen does not"
                f" serve (served: {', '.join(served)})"
            )
        raise argparse.ArgumentTypeError(f"unknown {what} {value!r}; choose from {known}")

    return check


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _range_ratio(text: str) -> tuple[float, float]:
    """vLLM's --random-range-ratio: one number for both, or {"input": r, "output": r}."""
    try:
        value: Any = float(text)
    except ValueError:
        value = _json_object(text)
    if isinstance(value, dict):
        try:
            ratios = (float(value["input"]), float(value["output"]))
        except (KeyError, TypeError, ValueError):
            raise argparse.ArgumentTypeError('expected {"input": r, "output": r}') from None
    else:
        ratios = (value, value)
    if not all(0 <= r < 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"range ratios must be in [0, 1), not {text}")
    return ratios


def add_target_options(group: argparse._ArgumentGroup) -> None:
    """vLLM's flags about the server, for every command that sends requests."""
    group.add_argument(
        "--header",
        metavar="KEY=VALUE",
        nargs="*",
        action="extend",
        default=[],
        help="a header for every request (repeatable); wins over Authorization: Bearer"
        " $OPENAI_API_KEY, which is sent when that variable is set",
    )
    group.add_argument("--insecure", action="store_true", help="accept any TLS certificate (https)")


def add_vllm_options(parser: argparse.ArgumentParser) -> None:
    """The rest of ``vllm bench serve``'s flags: served ones, then refused ones."""
    _add_vllm_target(parser.add_argument_group("vllm bench serve: target"))
    _add_vllm_dataset(parser.add_argument_group("vllm bench serve: datasets"))
    _add_vllm_traffic(parser.add_argument_group("vllm bench serve: traffic and sampling"))
    _add_vllm_result(parser.add_argument_group("vllm bench serve: result file"))
    refused = parser.add_argument_group(
        "vllm bench serve's flags that are refused (the error says why)"
    )
    owners = {flag: owner for owner, flags in UNSERVED_DATASET_FLAGS.items() for flag in flags}
    for flag, reason in REFUSED_FLAGS.items():
        short = f"{owners[flag]} only" if flag in owners else reason.split(";")[0]
        refused.add_argument(flag, action=RefusedFlag, help=f"refused: {short}", dest=_dest(flag))


def _add_vllm_target(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--backend",
        type=_choice(tuple(SERVED_BACKENDS), VLLM_BACKENDS, "backend"),
        help="openai or vllm: /v1/completions; openai-chat: /v1/chat/completions"
        " (default: from --endpoint)",
    )
    group.add_argument("--host", help="the server's host when --base-url is not given")
    group.add_argument(
        "--port",
        type=int,
        dest="port_of_server",
        help="the server's port when --base-url is not given",
    )
    group.add_argument(
        "--served-model-name", help="the model name sent in requests, when not --model's"
    )
    group.add_argument("--tokenizer", help="recorded as the result's tokenizer_id only")
    for flag, reason in NO_EFFECT_FLAGS.items():
        kwargs: dict[str, Any] = {"action": "store_true"} if flag == "--trust-remote-code" else {}
        group.add_argument(flag, help=f"accepted, no effect: {reason}", **kwargs)
    group.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        help="wait up to this long for GET /v1/models to answer (default: ask once)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        help="spread the measured requests over these model names (LoRA adapters)",
    )
    group.add_argument(
        "--lora-assignment",
        choices=("random", "round-robin"),
        help="--lora-modules: at random from --seed (default) or in turn",
    )


def _add_vllm_dataset(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--dataset-name",
        type=_choice(SERVED_DATASETS, VLLM_DATASETS, "dataset"),
        help="random: the custom workload with vLLM's length draws; burstgpt: the"
        " --dataset-path CSV's GPT-4 rows at --request-rate; prefix_repetition: shared"
        " prefixes; custom: a JSONL file of prompts (default: --workload)",
    )
    group.add_argument("--dataset-path", type=Path, help="burstgpt: the CSV; custom: the JSONL")
    group.add_argument(
        "--random-range-ratio",
        type=_range_ratio,
        help='random: lengths uniform in L*(1 +- r); r, or {"input": r, "output": r}',
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        help="random: tokens of one prefix every prompt starts with, on top of its length",
    )
    for name, default in PREFIX_REPETITION_DEFAULTS.items():
        group.add_argument(
            f"--prefix-repetition-{name.replace('_', '-')}",
            type=int,
            help=f"prefix_repetition: {name.replace('_', ' ')} (default {default})",
        )
    group.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        help=f"prefix_repetition: output tokens (default {PREFIX_REPETITION_OUTPUT_LEN})",
    )
    group.add_argument(
        "--custom-output-len",
        type=int,
        help=f"custom: output tokens (default {CUSTOM_OUTPUT_LEN}; -1: each row's output_tokens)",
    )
    group.add_argument(
        "--skip-chat-template",
        action="store_true",
        help="custom: send the prompts as they are (needed on /v1/completions: no"
        " tokenizer here renders the model's chat template)",
    )
    group.add_argument(
        "--disable-shuffle", action="store_true", help="custom, prefix_repetition: file order"
    )
    group.add_argument(
        "--no-oversample",
        action="store_true",
        help="custom: fewer rows than --num-prompts send fewer requests",
    )


def _add_vllm_traffic(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--ramp-up-strategy",
        choices=("linear", "exponential"),
        help="grow the rate from --ramp-up-start-rps to --ramp-up-end-rps (no --request-rate)",
    )
    group.add_argument("--ramp-up-start-rps", type=float, help="the ramp-up's first rate")
    group.add_argument("--ramp-up-end-rps", type=float, help="the ramp-up's last rate")
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="burstgpt, prefix_repetition, custom: exact output lengths (always on for"
        " our workloads and random)",
    )
    group.add_argument(
        "--request-id-prefix", help="send x-request-id: <prefix><index> with each request"
    )
    for flag, kind in (
        ("--top-p", float), ("--top-k", int), ("--min-p", float),
        ("--frequency-penalty", float), ("--presence-penalty", float),
        ("--repetition-penalty", float),
    ):  # fmt: skip
        group.add_argument(flag, type=kind, help="sampling: sent in every request's body")
    group.add_argument("--logprobs", type=int, help="/v1/completions: log-probabilities per token")
    group.add_argument(
        "--extra-body", type=_json_object, help="JSON fields added to every request's body"
    )


def _add_vllm_result(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--save-result",
        action="store_true",
        help="also write vLLM's result file in --result-dir (default: the current"
        " folder), named as vLLM names it",
    )
    group.add_argument("--append-result", action="store_true", help="append to that file instead")
    group.add_argument(
        "--save-detailed",
        action="store_true",
        help="with the per-request lists (ttfts, itls, input_lens, ...)",
    )
    group.add_argument("--result-filename", help="that file's name, instead of vLLM's")
    group.add_argument("--label", help="the result's label (and its file name's start)")
    group.add_argument(
        "--metadata",
        metavar="KEY=VALUE",
        nargs="*",
        action="extend",
        default=[],
        help="keys written into the result file",
    )
    group.add_argument(
        "--percentile-metrics",
        help=f"comma-separated, of {','.join(PERCENTILE_METRICS)}"
        f" (default {','.join(VLLM_DEFAULT_METRICS)})",
    )
    group.add_argument("--metric-percentiles", help="comma-separated percentiles (default 99)")
    group.add_argument(
        "--goodput",
        nargs="+",
        action="extend",
        metavar="METRIC:MS",
        help="SLOs of goodput: ttft:MS tpot:MS e2el:MS (as --slo-ttft-ms ...)",
    )


# ---- turning the flags into our configs -----------------------------------------------------


@dataclass(frozen=True)
class SaveOptions:
    """Where vLLM's ``--save-result`` file goes."""

    result_dir: Path | None
    result_filename: str | None
    append: bool


@dataclass
class VllmInvocation:
    """What vLLM's flags mean for our runs."""

    workload: WorkloadConfig | None  # None: our --workload flags decide
    run_fields: dict[str, Any]
    result: VllmResultOptions
    save: SaveOptions | None
    notes: list[str] = field(default_factory=list)


def key_values(items: Sequence[str], flag: str, separator: str = "=") -> dict[str, str]:
    pairs = {}
    for item in items:
        key, found, value = item.partition(separator)
        if not found:
            raise ValueError(f"{flag} {item!r}: expected KEY{separator}VALUE")
        pairs[key.strip()] = value.strip()
    return pairs


def resolve_endpoint(endpoint: str, backend: str | None) -> tuple[str, str | None]:
    """``--endpoint`` (ours: completions|chat; vLLM's: a URL path) and ``--backend``
    -> (completions|chat, the path when it is not the default one)."""
    if endpoint in ENDPOINT_PATHS:
        kind, path = endpoint, None
    elif endpoint.startswith("/") and endpoint.endswith("completions"):
        kind = "chat" if endpoint.endswith("chat/completions") else "completions"
        path = None if endpoint == ENDPOINT_PATHS[kind] else endpoint
    else:
        raise ValueError(
            f"--endpoint {endpoint!r}: completions, chat, or a path ending in /completions"
            " or /chat/completions"
        )
    if backend is not None and SERVED_BACKENDS[backend] != kind:
        raise ValueError(
            f"--backend {backend} speaks {ENDPOINT_PATHS[SERVED_BACKENDS[backend]]}, not"
            f" --endpoint {endpoint}"
        )
    return kind, path


def resolve_base_url(args: argparse.Namespace) -> str:
    """``--base-url``, else ``http://--host:--port`` (vLLM's defaults are ours)."""
    if args.base_url is not None:
        return args.base_url
    host = getattr(args, "host", None)
    port = getattr(args, "port_of_server", None)
    if host is None and port is None:
        return DEFAULT_BASE_URL
    host = host or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"http://{host}:{port or 8000}"


def resolve(args: argparse.Namespace) -> VllmInvocation:
    """Check vLLM's flags together and turn them into our configs."""
    notes = [
        f"{flag}: accepted, no effect: {reason}"
        for flag, reason in NO_EFFECT_FLAGS.items()
        if getattr(args, _dest(flag))
    ]
    kind, _ = resolve_endpoint(args.endpoint, args.backend)
    workload, dataset_notes = dataset_workload(args, kind)
    return VllmInvocation(
        workload=workload,
        run_fields=_run_fields(args, kind),
        result=_result_options(args),
        save=_save_options(args),
        notes=notes + dataset_notes,
    )


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _run_fields(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ignore_eos": _ignore_eos(args),
        "extra_body": _extra_body(args, kind),
        "request_id_prefix": args.request_id_prefix,
        "lora_modules": args.lora_modules,
        "ramp_up": _ramp_up(args),
    }
    if args.lora_assignment is not None:
        if not args.lora_modules:
            raise ValueError("--lora-assignment needs --lora-modules")
        fields["lora_assignment"] = args.lora_assignment
    if args.ready_check_timeout_sec is not None:
        fields["ready_timeout_s"] = args.ready_check_timeout_sec
    if args.served_model_name is not None:
        fields["model"] = args.served_model_name
    fields.update(_goodput(args))
    return fields


def _ignore_eos(args: argparse.Namespace) -> bool:
    """vLLM ignores EOS on its random dataset always, on the others when asked; our own
    workloads have exact lengths."""
    if args.dataset_name in (None, "random"):
        return True
    return bool(args.ignore_eos)


def _extra_body(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    sampling = {
        name: getattr(args, name)
        for name in (
            "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty",
        )
        if getattr(args, name) is not None
    }  # fmt: skip
    if args.logprobs is not None:
        if kind == "chat":
            raise ValueError("--logprobs is a /v1/completions field (vLLM's chat requests drop it)")
        sampling["logprobs"] = args.logprobs
    return {**sampling, **(args.extra_body or {})}


def _ramp_up(args: argparse.Namespace) -> RampUpConfig | None:
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    if args.ramp_up_strategy is None:
        if start is not None or end is not None:
            raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
        return None
    if any(math.isfinite(q) for q in args.qps):
        raise ValueError(
            "with --ramp-up-strategy the ramp sets the rate: leave out --request-rate/--qps"
        )
    if start is None or end is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    if not 0 < start <= end:
        raise ValueError(f"a ramp-up needs 0 < --ramp-up-start-rps <= --ramp-up-end-rps,"
                         f" not {start:g} and {end:g}")  # fmt: skip
    return RampUpConfig(strategy=args.ramp_up_strategy, start_rps=start, end_rps=end)


def _goodput(args: argparse.Namespace) -> dict[str, float]:
    """``--goodput ttft:300 tpot:20 e2el:900`` -> the SLO fields (``--slo-*-ms`` too)."""
    slos = key_values(args.goodput or [], "--goodput", separator=":")
    fields = {}
    for name, text in slos.items():
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {name}: choose from {', '.join(GOODPUT_METRICS)}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--goodput {name}:{text}: not milliseconds") from None
        if value <= 0:
            raise ValueError(f"--goodput {name}:{text}: must be positive")
        ours = getattr(args, f"slo_{name}_ms", None)
        if ours is not None and ours != value:
            raise ValueError(f"--goodput {name}:{text} disagrees with --slo-{name}-ms {ours:g}")
        fields[f"slo_{name}_ms"] = value
    return fields


def _result_options(args: argparse.Namespace) -> VllmResultOptions:
    metrics = _names(args.percentile_metrics, "--percentile-metrics")
    unknown = [m for m in metrics or () if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(
            f"--percentile-metrics {','.join(unknown)}: choose from {','.join(PERCENTILE_METRICS)}"
        )
    percentiles = _percentiles(args.metric_percentiles)
    return VllmResultOptions(
        backend=args.backend,
        label=args.label,
        model_id=args.model,
        tokenizer_id=args.tokenizer,
        num_prompts=args.num_requests,
        metadata=key_values(args.metadata, "--metadata"),
        percentile_metrics=metrics or VLLM_DEFAULT_METRICS,
        percentiles=percentiles or VLLM_DEFAULT_PERCENTILES,
        detailed=args.save_detailed,
    )


def result_file_options(options: VllmResultOptions, args: argparse.Namespace) -> VllmResultOptions:
    """The ``<run>.vllm.json`` file's options: vLLM's, with our broader figures where
    the flags are not given."""
    return replace(
        options,
        percentile_metrics=options.percentile_metrics
        if args.percentile_metrics
        else ("ttft", "tpot", "itl", "e2el"),
        percentiles=options.percentiles if args.metric_percentiles else (50.0, 90.0, 95.0, 99.0),
    )


def _names(text: str | None, flag: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ValueError(f"{flag}: nothing named")
    return names


def _percentiles(text: str | None) -> tuple[float, ...] | None:
    parts = _names(text, "--metric-percentiles")
    if parts is None:
        return None
    try:
        values = tuple(float(part) for part in parts)
    except ValueError:
        raise ValueError(f"--metric-percentiles {text}: expected numbers") from None
    if not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text}: percentiles are 0 to 100")
    return values


def _save_options(args: argparse.Namespace) -> SaveOptions | None:
    if not (args.save_result or args.append_result):
        if args.result_filename is not None:
            raise ValueError("--result-filename names the --save-result file: add that flag")
        return None
    if args.result_filename is not None and len(args.qps) > 1 and not args.append_result:
        raise ValueError("--result-filename names one file: give one rate, or --append-result")
    return SaveOptions(args.out, args.result_filename, args.append_result)


# ---- datasets ----------------------------------------------------------------------------------


def dataset_workload(
    args: argparse.Namespace, kind: str
) -> tuple[WorkloadConfig | None, list[str]]:
    """vLLM's ``--dataset-name`` and its flags as one of our workloads (None: ours), and
    notes on the flags that, as in vLLM, do nothing with the dataset chosen."""
    dataset = args.dataset_name
    if dataset is None and _given(args, "random_range_ratio", "random_prefix_len"):
        dataset = "random"  # vLLM's default dataset, implied by its flags
    notes = _check_dataset_flags(args, dataset)
    if dataset is None:
        return None, notes
    if args.workload is not None or args.trace is not None:
        raise ValueError("--dataset-name chooses the requests: leave out --workload and --trace")
    if args.spread and dataset != "random":
        raise ValueError("--spread applies to the random dataset (and our custom workload)")
    build = {
        "random": _random_workload,
        "burstgpt": _burstgpt_workload,
        "prefix_repetition": _prefix_repetition_workload,
        "custom": _prompt_file_workload,
    }[dataset]
    return build(args, kind), notes


def _given(args: argparse.Namespace, *dests: str) -> list[str]:
    """The flags among ``dests`` given on the command line (their defaults are None)."""
    given = [d for d in dests if getattr(args, d, None) not in (None, False)]
    return [f"--{d.replace('_', '-')}" for d in given]


# Flags that belong to some datasets: with another one vLLM ignores them; we say so.
_DATASET_FLAGS = {
    ("random",): ("input_len", "random_range_ratio", "random_prefix_len"),
    ("prefix_repetition",): (
        "prefix_repetition_prefix_len", "prefix_repetition_suffix_len",
        "prefix_repetition_num_prefixes", "prefix_repetition_output_len",
    ),
    ("custom",): ("custom_output_len", "skip_chat_template", "no_oversample"),
    ("random", "prefix_repetition", "custom"): ("output_len",),
    ("prefix_repetition", "custom"): ("disable_shuffle",),
}  # fmt: skip
_PATH_DATASETS = ("burstgpt", "custom")


def _check_dataset_flags(args: argparse.Namespace, dataset: str | None) -> list[str]:
    if args.dataset_path is not None and dataset not in _PATH_DATASETS:
        raise ValueError(f"--dataset-path is for --dataset-name {' or '.join(_PATH_DATASETS)}")
    if dataset in _PATH_DATASETS and args.dataset_path is None:
        raise ValueError(f"--dataset-name {dataset} needs --dataset-path")
    notes = []
    for owners, dests in _DATASET_FLAGS.items():
        if dataset is None:
            # Our own workloads: --input-len and --output-len are the custom workload's,
            # and vLLM's default dataset (random) ignores the others.
            dests = tuple(d for d in dests if d not in ("input_len", "output_len"))
        stray = _given(args, *dests)
        if stray and (dataset or "random") not in owners:
            chosen = dataset or "random (vLLM's default)"
            notes.append(
                f"{', '.join(stray)}: no effect with --dataset-name {chosen}, as in vLLM"
                f" (they apply to {' and '.join(owners)})"
            )
    return notes


def _random_workload(args: argparse.Namespace, kind: str) -> WorkloadConfig:
    ratios = args.random_range_ratio
    prefix_len = args.random_prefix_len or 0
    if prefix_len and kind == "chat":
        raise ValueError("--random-prefix-len needs /v1/completions (token-id prompts)")
    return WorkloadConfig(
        name=CUSTOM_WORKLOAD,
        input_len=args.input_len or RANDOM_LENGTHS[0],
        output_len=args.output_len or RANDOM_LENGTHS[1],
        spread=args.spread,
        input_range_ratio=None if ratios is None else ratios[0],
        output_range_ratio=None if ratios is None else ratios[1],
        prefix_len=prefix_len,
    )


def _burstgpt_workload(args: argparse.Namespace, kind: str) -> WorkloadConfig:
    return WorkloadConfig(
        name="T-general",
        trace="burstgpt",
        trace_file=args.dataset_path,
        trace_models=[BURSTGPT_MODEL],
    )


def _prefix_repetition_workload(args: argparse.Namespace, kind: str) -> WorkloadConfig:
    if kind == "chat":
        raise ValueError("--dataset-name prefix_repetition needs /v1/completions (token ids)")
    values = {
        name: getattr(args, f"prefix_repetition_{name}") or default
        for name, default in PREFIX_REPETITION_DEFAULTS.items()
    }
    output_len = (
        args.output_len or args.prefix_repetition_output_len or PREFIX_REPETITION_OUTPUT_LEN
    )
    return WorkloadConfig(
        name=PREFIX_REPETITION_WORKLOAD,
        output_len=output_len,
        shuffle=not args.disable_shuffle,
        **values,
    )


def _prompt_file_workload(args: argparse.Namespace, kind: str) -> WorkloadConfig:
    if kind == "completions" and not args.skip_chat_template:
        raise ValueError(
            "--dataset-name custom renders the model's chat template on the client unless"
            " --skip-chat-template, and python -m loadgen loads no tokenizer: add"
            " --skip-chat-template (prompts sent as they are), or use --backend openai-chat"
            " --endpoint /v1/chat/completions (the server applies its template)"
        )
    output_len = args.output_len or args.custom_output_len or CUSTOM_OUTPUT_LEN
    return WorkloadConfig(
        name=PROMPT_FILE_WORKLOAD,
        prompt_file=args.dataset_path,
        output_len=None if output_len == -1 else output_len,
        shuffle=not args.disable_shuffle,
        oversample=not args.no_oversample,
    )
