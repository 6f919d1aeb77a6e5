"""What the subcommands share: option groups, list and map parsers, the run config
from the command line, output folders, the run report."""

from __future__ import annotations

import argparse
import logging
import math
import resource
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from loadgen.config import (
    ARRIVALS,
    DEFAULT_BASE_URL,
    DEFAULT_WARMUP_REQUESTS,
    STUDY_REQUESTS_PER_CELL,
    WORKLOADS,
    RunConfig,
    WorkloadConfig,
)
from loadgen.data.burstgpt import (
    BURSTGPT_URL,
    default_cache_dir,
)
from loadgen.outputs.exposition import Exposition
from loadgen.outputs.report import (
    plot_run,
    print_run_table,
    summary_row,
    write_run_json,
    write_summary_csv,
)
from loadgen.scheduling.runner import RunResult
from loadgen.vllm_compat.cli import (
    VllmInvocation,
    add_target_options,
    key_values,
    resolve_base_url,
    resolve_endpoint,
    result_file_options,
)
from loadgen.vllm_compat.result import save_vllm_result, write_vllm_result

RESULTS_ROOT = Path("results/loadgen")


def _write_run_outputs(
    result: RunResult,
    out: Path,
    args: argparse.Namespace,
    vllm: VllmInvocation,
    console: Console,
) -> None:
    console.print(f"records: {write_run_json(result, out)}")
    ours = write_vllm_result(result, out, result_file_options(vllm.result, args))
    console.print(f"vLLM-format result: {ours}")
    if vllm.save is not None:
        save = vllm.save
        path = save_vllm_result(
            result, vllm.result, save.result_dir, save.result_filename, save.append
        )
        console.print(f"vllm bench serve --save-result: {path}")
    if not args.no_plots:
        console.print(f"plot: {plot_run(result, out / f'{result.run_id}.png')}")


def float_list(text: str) -> list[float]:
    try:
        return [math.inf if part.strip() == "inf" else float(part) for part in text.split(",")]
    except ValueError:
        message = f"expected numbers or inf, comma-separated: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


class _RenamedFlag(argparse.Action):
    """A flag this CLI renamed: refused with its new name, not as merely unknown."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(f"{'/'.join(self.option_strings)} is now {self.new}")


def add_shape_flag(parser: argparse.ArgumentParser | Any, flag: str, **kwargs: Any) -> None:
    """``--shape`` or ``--shapes`` (the serving shape: tp, pp, dp, pd, ...), and the
    refusal of the name it had before (``--mode``, ``--modes``)."""
    parser.add_argument(flag, **kwargs)
    old = flag.replace("shape", "mode")
    parser.add_argument(old, action=_RenamedFlag, new=flag, dest=f"renamed_{old[2:]}")


def name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def url_map(text: str) -> dict[str, str]:
    pairs = {}
    for part in name_list(text):
        shape, _, url = part.partition("=")
        if not url:
            raise argparse.ArgumentTypeError(f"expected SHAPE=URL, got {part!r}")
        pairs[shape] = url
    return pairs


def add_run_target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("target")
    group.add_argument(
        "--base-url", help=f"the OpenAI-compatible server (default {DEFAULT_BASE_URL})"
    )
    group.add_argument(
        "--endpoint",
        default="completions",
        help="completions: exact token-id prompts; chat: calibrated text; or a URL path"
        " as vLLM takes it (/v1/completions, /v1/chat/completions)",
    )
    group.add_argument("--model", help="default: the first model of GET /v1/models")
    group.add_argument("--max-model-len", type=int, help="default: from GET /v1/models")
    add_shape_flag(
        group, "--shape", help="label of the serving shape (tp, pp, dp, pd); default: the router's"
    )
    add_target_options(group)


def add_workload_options(parser: argparse.ArgumentParser, single: bool = True) -> None:
    group = parser.add_argument_group("workload")
    if single:
        group.add_argument(
            "--workload",
            choices=WORKLOADS.names(),
            help="default: general, or T-burst-replay with --trace",
        )
        group.add_argument(
            "--input-len", "--random-input-len", type=int, help="custom workload: prompt tokens"
        )
        group.add_argument(
            "--output-len", "--random-output-len", type=int, help="custom workload: output tokens"
        )
        group.add_argument(
            "--spread",
            type=float,
            default=0.0,
            help="custom workload: lengths uniform in L*(1 +- spread)",
        )
        group.add_argument(
            "--conversations",
            type=int,
            default=8,
            help="multi-turn workload: conversations, whose turns take turns (default 8);"
            " --input-len is a user turn, --output-len an answer",
        )
        group.add_argument(
            "--system-prompt-len",
            type=int,
            default=0,
            help="multi-turn workload: tokens of the system prompt every conversation shares",
        )
    group.add_argument(
        "--trace",
        choices=("burstgpt", "burstgpt-synthetic", "recorded"),
        help="source of the T-* workloads (default burstgpt: the real CSV); recorded: a"
        " record of the router's own traffic (router.traffic_record), replayed",
    )
    group.add_argument(
        "--trace-file",
        type=Path,
        help="the BurstGPT CSV (else cache, else download), or the router's traffic record",
    )
    group.add_argument(
        "--trace-cache-dir",
        type=Path,
        default=None,
        help=f"where the downloaded CSV is kept (default {default_cache_dir()})",
    )
    group.add_argument("--trace-url", default=BURSTGPT_URL, help="download source (a mirror)")
    group.add_argument(
        "--trace-model", type=name_list, help="keep these models, e.g. ChatGPT,GPT-4"
    )
    group.add_argument(
        "--trace-log-type", type=name_list, help="keep these log types, e.g. 'Conversation log'"
    )
    group.add_argument("--trace-start", type=int, default=0, help="T-burst-replay: first row")
    group.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="T-burst-replay: multiply the trace's gaps (0.1 = ten times faster)",
    )


def add_load_options(parser: argparse.ArgumentParser, qps_default: str) -> None:
    group = parser.add_argument_group("load")
    group.add_argument(
        "--qps",
        "--request-rate",
        type=float_list,
        default=float_list(qps_default),
        help=f"request rates, comma-separated; inf = unlimited (default {qps_default})",
    )
    group.add_argument(
        "--arrivals",
        choices=ARRIVALS.names(),
        help="process of a finite QPS (default: poisson; gamma when --burstiness is not 1,"
        " constant when it is inf, as vLLM's)",
    )
    group.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma gaps; 1 is Poisson, below 1 burstier, inf constant",
    )
    group.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    group.add_argument(
        "--engine-time-scale",
        type=float,
        default=1.0,
        help="the server's simulated engines run this much slower (engine.time_scale):"
        " arrivals are spread and latencies divided by it",
    )
    group.add_argument(
        "--num-requests",
        "--num-prompts",
        type=int,
        default=STUDY_REQUESTS_PER_CELL,
        help="measured requests per run (the study: 200)",
    )
    group.add_argument(
        "--warmup-requests",
        "--num-warmups",
        type=int,
        default=DEFAULT_WARMUP_REQUESTS,
        help="sent before each run, left out of the figures",
    )
    group.add_argument("--seed", type=int, default=0, help="same seed, same requests and schedule")
    group.add_argument("--timeout", type=float, default=1800.0, help="seconds per request, total")
    group.add_argument("--read-timeout", type=float, default=300.0, help="seconds between bytes")
    group.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds to open a connection"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    group.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask for vLLM's return_token_ids (count one token per chunk)",
    )


def add_report_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("figures and reports")
    group.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT target")
    group.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT target")
    group.add_argument("--metrics-port", type=int, help="expose live Prometheus metrics here")
    group.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port")
    group.add_argument(
        "--prometheus-url", help="also read GPU utilization/KV usage from Prometheus"
    )
    group.add_argument(
        "--no-server-metrics", action="store_true", help="do not scrape the server's /metrics"
    )
    group.add_argument(
        "--server-sample-interval",
        type=float,
        default=0.5,
        help="seconds between /metrics samples during a run",
    )
    group.add_argument(
        "--out", "--result-dir", type=Path, help="output folder (default results/loadgen/<time>)"
    )
    group.add_argument("--run-name", help="name of the run's files (one QPS only)")
    group.add_argument(
        "--no-progress", "--disable-tqdm", action="store_true", help="no live progress display"
    )
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("-v", "--verbose", action="store_true", help="log in detail")


def workload_config(args: argparse.Namespace, name: str | None) -> WorkloadConfig:
    if name is None:
        if getattr(args, "input_len", None) or getattr(args, "output_len", None):
            name = "custom"
        else:
            replays = {"recorded": "recorded-replay"}
            name = replays.get(args.trace, "T-burst-replay") if args.trace else "general"
    return WorkloadConfig(
        name=name,
        input_len=getattr(args, "input_len", None),
        output_len=getattr(args, "output_len", None),
        spread=getattr(args, "spread", 0.0),
        conversations=getattr(args, "conversations", 8),
        prefix_len=getattr(args, "system_prompt_len", 0),
        trace=args.trace or "burstgpt",
        trace_file=args.trace_file,
        trace_cache_dir=args.trace_cache_dir,
        trace_url=args.trace_url,
        trace_models=args.trace_model,
        trace_log_types=args.trace_log_type,
        trace_start=args.trace_start,
        time_scale=args.time_scale,
    )


def arrival_process(args: argparse.Namespace) -> str:
    """``--arrivals``, else what ``--burstiness`` means in vLLM's client."""
    if args.arrivals is None:
        if math.isinf(args.burstiness):
            return "constant"
        return "poisson" if args.burstiness == 1 else "gamma"
    if args.burstiness != 1 and args.arrivals != "gamma":
        raise ValueError(f"--burstiness shapes gamma arrivals, not --arrivals {args.arrivals}")
    return args.arrivals


def run_config(
    args: argparse.Namespace,
    workload: WorkloadConfig,
    qps: float,
    extra: dict[str, object] | None = None,
) -> RunConfig:
    """One run's config from the command line; ``extra``: fields vLLM's flags set."""
    endpoint, path = resolve_endpoint(args.endpoint, getattr(args, "backend", None))
    fields: dict[str, object] = dict(
        base_url=resolve_base_url(args),
        endpoint=endpoint,
        endpoint_path=path,
        headers=key_values(args.header, "--header"),
        verify_tls=not args.insecure,
        model=args.model,
        max_model_len=args.max_model_len,
        workload=workload,
        qps=qps,
        arrival_process=arrival_process(args),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        engine_time_scale=args.engine_time_scale,
        num_requests=args.num_requests,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
        connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout,
        request_timeout_s=args.timeout,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        shape=args.shape,
        run_name=getattr(args, "run_name", None),
        prometheus_url=args.prometheus_url,
        server_metrics=not args.no_server_metrics,
        server_sample_interval_s=args.server_sample_interval,
        temperature=args.temperature,
        return_token_ids=not args.no_token_ids,
        show_progress=not args.no_progress,
    )
    fields.update(extra or {})
    return RunConfig.model_validate(fields)


def exposition_of(args: argparse.Namespace, console: Console) -> Exposition | None:
    if args.metrics_port is None:
        return None
    exposition = Exposition()
    exposition.serve(args.metrics_port, args.metrics_host)
    console.print(f"live metrics on http://{args.metrics_host}:{args.metrics_port}/metrics")
    return exposition


def out_dir(args: argparse.Namespace, kind: str) -> Path:
    if args.out is not None:
        return args.out
    return RESULTS_ROOT / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def raise_open_file_limit() -> None:
    """Each connection is a file descriptor; the default soft limit of 1024 is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def report_runs(
    results: list[RunResult],
    out: Path,
    args: argparse.Namespace,
    vllm: VllmInvocation,
    console: Console,
) -> None:
    print_run_table(console, results)
    for result in results:
        _write_run_outputs(result, out, args, vllm, console)
    console.print(
        f"summary: {write_summary_csv([summary_row(r) for r in results], out / 'summary.csv')}"
    )


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
