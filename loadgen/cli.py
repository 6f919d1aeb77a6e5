"""``python -m loadgen``: run, sweep, demo, fake-server, trace-stats, report."""

from __future__ import annotations

import argparse
import logging
import math
import resource
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console

from loadgen import advisor, knee, placement
from loadgen.burstgpt import (
    BURSTGPT_URL,
    STUDY_MEANS,
    TraceUnavailableError,
    default_cache_dir,
    subset_means,
)
from loadgen.client import request_headers
from loadgen.config import (
    ARRIVALS,
    DEFAULT_BASE_URL,
    DEFAULT_WARMUP_REQUESTS,
    STUDY_REQUESTS_PER_CELL,
    WORKLOADS,
    RunConfig,
    WorkloadConfig,
)
from loadgen.demo import DEMO_CONFIG, DEMO_RATE, DEMO_REQUESTS, DemoOptions, run_demo
from loadgen.deployment_plan import DeployTarget
from loadgen.eventloop import run_event_loop
from loadgen.exposition import Exposition
from loadgen.fake_server import FakeServerConfig, run_fake_server
from loadgen.launcher import DEFAULT_DEPLOYMENTS_DIR, LaunchError
from loadgen.panels import render_report  # its ReportError is a ValueError
from loadgen.placement_advice import PlacementQuestion, advise_placement
from loadgen.profiling import (
    ProfileGrid,
    ProfileTarget,
    kv_capacity_tokens,
    measure,
    profile_from,
    profile_table,
    save_samples,
    served_models,
    without_path_cost,
)
from loadgen.report import (
    plot_knee,
    plot_run,
    print_knee,
    print_run_table,
    print_trace_stats,
    summary_row,
    write_knee,
    write_run_json,
    write_summary_csv,
)
from loadgen.runner import RunError, RunResult, execute_run
from loadgen.simulate import SimulatedTarget, simulate_run
from loadgen.sizing import ModelDims, model_dims, read_model_config
from loadgen.sweep import (
    SMOKE_QPS,
    SMOKE_REQUESTS,
    SMOKE_WARMUP_REQUESTS,
    SMOKE_WORKLOADS,
    STUDY_QPS,
    STUDY_SHAPES,
    STUDY_WORKLOADS,
    SweepConfig,
    run_sweep,
)
from loadgen.vllm_cli import (
    VllmInvocation,
    add_target_options,
    add_vllm_options,
    key_values,
    normalize_flag_names,
    resolve,
    resolve_base_url,
    resolve_endpoint,
    result_file_options,
)
from loadgen.vllm_result import save_vllm_result, write_vllm_result
from loadgen.workloads import load_trace
from splitserve.latency.profile import shipped_profiles
from splitserve.packaging import PackageConflictError, check_top_level_packages

SUBCOMMANDS = (
    "run",
    "sweep",
    "knee",
    "advise",
    "demo",
    "fake-server",
    "trace-stats",
    "report",
    "profile",
    "simulate",
)
RESULTS_ROOT = Path("results/loadgen")

RUN_EXAMPLES = """examples:
  # the study's general workload at QPS 1,2,4,8,inf, 200 requests each, against serve run
  python -m loadgen --workload general --qps 1,2,4,8,inf
  # custom lengths with a +-20% spread, Poisson 4 req/s, goodput under SLOs
  python -m loadgen --input-len 512 --output-len 64 --spread 0.2 --qps 4 \\
      --slo-ttft-ms 200 --slo-tpot-ms 20
  # BurstGPT: the long-prompt subset at QPS 8; the trace's own arrivals, 10x faster
  python -m loadgen --trace burstgpt --trace-file BurstGPT_1.csv --workload T-prefill-heavy --qps 8
  python -m loadgen --trace burstgpt --workload T-burst-replay --time-scale 0.1
  # offline: the BurstGPT-shaped generator (labelled synthetic)
  python -m loadgen --trace burstgpt-synthetic --workload T-general --qps 8
  # live metrics for Prometheus/Grafana while it runs; chat endpoint
  python -m loadgen --metrics-port 9400 --endpoint chat --qps inf --max-concurrency 16
  # vllm bench serve's command line, as it is; --save-result writes vLLM's file too
  python -m loadgen --backend vllm --model M --endpoint /v1/completions \
      --dataset-name random --random-input-len 512 --random-output-len 64 \
      --request-rate 4 --num-prompts 100 --save-result --result-dir DIR \
      --goodput ttft:300 tpot:20 --percentile-metrics ttft,tpot,itl,e2el

other commands: sweep (the study's matrix), demo (pd.yaml + a BurstGPT-shaped run),
fake-server (a zero-latency streaming server), trace-stats (BurstGPT subset means).
Run `python -m loadgen COMMAND --help` for each."""

SWEEP_EXAMPLES = """examples:
  # the study's whole matrix: starts and stops python -m deployments.serve <shape> per shape
  python -m loadgen sweep --shapes tp,pp,dp,pd_always --qps 1,2,4,8,inf --trace-file BurstGPT_1.csv
  # a few minutes on a laptop: 10 requests a cell, QPS 4 and inf, synthetic trace
  python -m loadgen sweep --smoke --shapes dp,tp
  # servers that are already up
  python -m loadgen sweep --urls tp=http://10.0.0.5:8000,dp=http://10.0.0.6:8000"""


def _float_list(text: str) -> list[float]:
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


def _add_shape_flag(parser: argparse.ArgumentParser | Any, flag: str, **kwargs: Any) -> None:
    """``--shape`` or ``--shapes`` (the serving shape: tp, pp, dp, pd, ...), and the
    refusal of the name it had before (``--mode``, ``--modes``)."""
    parser.add_argument(flag, **kwargs)
    old = flag.replace("shape", "mode")
    parser.add_argument(old, action=_RenamedFlag, new=flag, dest=f"renamed_{old[2:]}")


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _url_map(text: str) -> dict[str, str]:
    pairs = {}
    for part in _name_list(text):
        shape, _, url = part.partition("=")
        if not url:
            raise argparse.ArgumentTypeError(f"expected SHAPE=URL, got {part!r}")
        pairs[shape] = url
    return pairs


def _add_target_options(parser: argparse.ArgumentParser) -> None:
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
    _add_shape_flag(
        group, "--shape", help="label of the serving shape (tp, pp, dp, pd); default: the router's"
    )
    add_target_options(group)


def _add_workload_options(parser: argparse.ArgumentParser, single: bool = True) -> None:
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
        "--trace-model", type=_name_list, help="keep these models, e.g. ChatGPT,GPT-4"
    )
    group.add_argument(
        "--trace-log-type", type=_name_list, help="keep these log types, e.g. 'Conversation log'"
    )
    group.add_argument("--trace-start", type=int, default=0, help="T-burst-replay: first row")
    group.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="T-burst-replay: multiply the trace's gaps (0.1 = ten times faster)",
    )


def _add_load_options(parser: argparse.ArgumentParser, qps_default: str) -> None:
    group = parser.add_argument_group("load")
    group.add_argument(
        "--qps",
        "--request-rate",
        type=_float_list,
        default=_float_list(qps_default),
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


def _add_report_options(parser: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load an OpenAI-compatible endpoint with the study's workloads or the"
        " BurstGPT trace at set rates; report TTFT, ITL, E2E, throughput and goodput.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_options(parser)
    _add_workload_options(parser)
    _add_load_options(parser, "inf")
    _add_report_options(parser)
    add_vllm_options(parser)
    return parser


def build_knee_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen knee",
        description=knee.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_target_options(parser)
    _add_workload_options(parser)
    _add_load_options(parser, "1")
    _add_report_options(parser)
    group = parser.add_argument_group("search")
    defaults = knee.KneeSearchConfig()
    group.add_argument(
        "--attainment",
        type=float,
        default=defaults.attainment,
        help="share of requests that must meet every SLO",
    )
    group.add_argument("--qps-start", type=float, default=defaults.qps_start)
    group.add_argument("--qps-max", type=float, default=defaults.qps_max)
    group.add_argument("--tolerance", type=float, default=defaults.tolerance)
    group.add_argument("--max-steps", type=int, default=defaults.max_steps)
    return parser


def build_sweep_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen sweep",
        description="The study's matrix: shapes x workloads x QPS; starts and stops each"
        " Serve application (python -m deployments.serve <shape>) unless given --urls.",
        epilog=SWEEP_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    matrix = parser.add_argument_group("matrix")
    _add_shape_flag(matrix, "--shapes", type=_name_list, default=list(STUDY_SHAPES))

    matrix.add_argument(
        "--workloads", type=_name_list, help=f"default: {','.join(STUDY_WORKLOADS)}"
    )
    matrix.add_argument(
        "--smoke",
        action="store_true",
        help=f"{SMOKE_REQUESTS} requests a cell, QPS 4,inf, synthetic trace",
    )
    matrix.add_argument("--urls", type=_url_map, default={}, help="SHAPE=URL,...: do not launch")
    matrix.add_argument(
        "--launch-command",
        help="instead of serve run: a command template with {shape} {config} {port}",
    )
    matrix.add_argument("--deployments-dir", type=Path, help="where <shape>.yaml files are")
    matrix.add_argument("--port", type=int, default=8000, help="port of launched servers")
    matrix.add_argument("--ready-timeout", type=float, default=600.0)
    matrix.add_argument("--stop-timeout", type=float, default=120.0)
    matrix.add_argument("--figure-qps", type=float, default=8.0, help="QPS of Figure 1's bars")
    _add_target_options(parser)
    _add_workload_options(parser, single=False)
    _add_load_options(parser, ",".join("inf" if math.isinf(q) else f"{q:g}" for q in STUDY_QPS))
    _add_report_options(parser)
    return parser


def build_demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen demo",
        description="Start deployments/<config>.yaml, replay a BurstGPT-shaped trace on it,"
        " print the table and the plots' path, stop it.",
    )
    parser.add_argument(
        "--config", default=DEMO_CONFIG, help="a name under --deployments-dir (<name>.yaml)"
    )
    parser.add_argument("--deployments-dir", type=Path, default=DEFAULT_DEPLOYMENTS_DIR)
    parser.add_argument("--num-requests", type=int, default=DEMO_REQUESTS)
    parser.add_argument("--rate", type=float, default=DEMO_RATE, help="mean requests/s")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--out", type=Path, default=RESULTS_ROOT / "demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--launch-command", help="instead of serve run: a command template with {config} {port}"
    )
    return parser


def build_fake_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen fake-server",
        description="A tiny OpenAI-compatible streaming server (zero latency by default).",
    )
    defaults = FakeServerConfig()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--reject-every", type=int, default=0, help="503 every Nth request")
    parser.add_argument("--reject-status", type=int, default=503, choices=(429, 503))
    _add_shape_flag(parser, "--shape", default=defaults.shape)
    return parser


def build_trace_stats_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen trace-stats",
        description="Rows and mean lengths of the BurstGPT subsets, next to the study's Table 2.",
    )
    _add_workload_options(parser, single=False)
    parser.add_argument("--max-model-len", type=int, default=4096)
    return parser


def build_report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen report",
        description="Render the dashboard's key panels as PNG from a run's JSON, a folder of"
        " runs, or a sweep's output folder (its figures from sweep.csv, plus every run).",
    )
    parser.add_argument("path", type=Path, help="RUN.json, or a run/sweep output folder")
    parser.add_argument("--out", type=Path, default=None, help="default: beside the input")
    return parser


# ---- building configs ---------------------------------------------------------------------


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


def _exposition(args: argparse.Namespace, console: Console) -> Exposition | None:
    if args.metrics_port is None:
        return None
    exposition = Exposition()
    exposition.serve(args.metrics_port, args.metrics_host)
    console.print(f"live metrics on http://{args.metrics_host}:{args.metrics_port}/metrics")
    return exposition


def _out_dir(args: argparse.Namespace, kind: str) -> Path:
    if args.out is not None:
        return args.out
    return RESULTS_ROOT / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def raise_open_file_limit() -> None:
    """Each connection is a file descriptor; the default soft limit of 1024 is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---- commands -----------------------------------------------------------------------------


def command_run(argv: list[str], console: Console) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.run_name and len(args.qps) > 1:
        raise ValueError("--run-name names one run; give one --qps value with it")
    vllm = resolve(args)
    for note in vllm.notes:
        console.print(f"[yellow]note:[/] {note}")
    workload = vllm.workload or workload_config(args, args.workload)
    if workload.is_trace:
        load_trace(workload)  # a missing trace is our problem: say so before contacting anyone
    configs = [run_config(args, workload, qps, vllm.run_fields) for qps in args.qps]
    if workload.is_replay and len(configs) > 1:
        configs = configs[:1]  # the replay follows the trace's clock, not a QPS
    out = _out_dir(args, "run")
    exposition = _exposition(args, console)

    async def all_runs() -> list[RunResult]:
        return [await execute_run(config, console, exposition) for config in configs]

    _report_runs(run_event_loop(all_runs()), out, args, vllm, console)
    return 0


def _report_runs(
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


def command_knee(argv: list[str], console: Console) -> int:
    args = build_knee_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise ValueError(
            "the knee is where the SLOs stop being met: give --slo-ttft-ms and/or --slo-tpot-ms"
        )
    search = knee.KneeSearchConfig(
        attainment=args.attainment,
        qps_start=args.qps_start,
        qps_max=args.qps_max,
        tolerance=args.tolerance,
        max_steps=args.max_steps,
    )
    workload = workload_config(args, args.workload)
    out = _out_dir(args, "knee")
    args.no_progress = True  # one line per step instead

    async def run_at(qps: float) -> knee.KneeStep:
        result = await execute_run(run_config(args, workload, qps), console)
        write_run_json(result, out)
        step = knee.step_of(qps, result.summary)
        console.print(
            f"qps {qps:g}: {100 * step.attainment:.0f}% met the SLOs,"
            f" goodput {step.goodput:.2f} req/s"
        )
        return step

    result = run_event_loop(knee.find_knee(run_at, search))
    print_knee(console, result)
    console.print(f"knee: {write_knee(result, out)}")
    if not args.no_plots:
        console.print(f"plot: {plot_knee(result, out / 'knee.png')}")
    return 0


ADVISE_SHAPES = ("single", "dp", "pd_always", "pd", "auto")
ADVISE_SMOKE_QPS = "1,2,4"
ADVISE_SMOKE_REQUESTS = 24
SEARCH_REQUESTS = 500
SEARCH_RUN_SECONDS = 20.0


def build_advise_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen advise",
        description=advisor.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--sweep", type=Path, help="a sweep's folder (with runs/*.json)")
    source.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="measure nothing: run the --shapes' cells offline on simulated engines that keep"
        " this latency profile's time (a file, or a shipped family such as"
        " h100-llama-3.1-8b: each pool takes its TP x PP member); seconds, not minutes."
        " With --devices N: search every placement of N devices (shapes, parallel degrees,"
        " P:D ratios) for the highest goodput",
    )
    source.add_argument(
        "--smoke",
        action="store_true",
        help=f"run a small sweep first: {','.join(ADVISE_SHAPES)}, QPS {ADVISE_SMOKE_QPS},"
        f" {ADVISE_SMOKE_REQUESTS} requests a cell (minutes on the embedded model)",
    )
    _add_shape_flag(
        parser,
        "--shapes",
        type=_name_list,
        help=f"default: {','.join(ADVISE_SHAPES)}; a placement search:"
        f" {','.join(placement.SEARCH_SHAPES)}",
    )
    parser.add_argument("--workload", default="general", help="--smoke's workload")
    parser.add_argument("--trace", choices=("burstgpt", "burstgpt-synthetic", "recorded"))
    parser.add_argument("--trace-file", type=Path, help="with --trace recorded: the record")
    parser.add_argument("--input-len", type=int, help="a placement search: fixed prompt tokens")
    parser.add_argument("--output-len", type=int, help="a placement search: fixed output tokens")
    parser.add_argument("--qps", default=ADVISE_SMOKE_QPS, help="--smoke's rates")
    parser.add_argument(
        "--num-requests",
        type=int,
        help=f"requests a run (default {ADVISE_SMOKE_REQUESTS}; a placement search"
        f" {SEARCH_REQUESTS})",
    )
    parser.add_argument(
        "--qps-start", type=float, default=1.0, help="a placement search's first rate"
    )
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=SEARCH_RUN_SECONDS,
        help="a placement search: each run's arrivals span this long, so that a high rate"
        " reaches steady state (at least --num-requests requests)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token objective")
    parser.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token objective")
    parser.add_argument(
        "--attainment",
        type=float,
        default=0.9,
        help="share of requests that must meet the objectives",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="--smoke: run every cell this many times"
    )
    parser.add_argument("--deployments-dir", type=Path, default=DEFAULT_DEPLOYMENTS_DIR)
    parser.add_argument("--yaml", type=Path, help="default: deployments/advised-<workload>.yaml")
    parser.add_argument(
        "--out", type=Path, help="report folder (default results/loadgen/advice-<time>)"
    )
    target = parser.add_argument_group("where the advised YAML runs")
    target.add_argument(
        "--target",
        choices=("cpu", "gpu"),
        help="gpu: accelerator gpu, the model's own dtype, no cpu_binds or kv_cache_gib"
        " (default: cpu; gpu for a placement search, whose profiles are GPUs')",
    )
    target.add_argument("--model", help="a Hugging Face id or local folder (default: the YAML's)")
    target.add_argument("--target-rate", type=float, help="size the pools for this many req/s")
    target.add_argument(
        "--devices", type=int, help="size for this many devices (default: as measured)"
    )
    target.add_argument("--devices-per-node", type=int, default=8, help="the largest TP degree")
    target.add_argument(
        "--device-memory-gib", type=float, default=80.0, help="memory of one device (GPU)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def command_advise(argv: list[str], console: Console) -> int:
    args = build_advise_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        raise ValueError("advice needs objectives: give --slo-ttft-ms and/or --slo-tpot-ms")
    out = _out_dir(args, "advice")
    if args.simulate and args.devices:
        return _placement_search(args, out, console)
    args.target = args.target or "cpu"
    args.shapes = args.shapes or list(ADVISE_SHAPES)
    args.num_requests = args.num_requests or ADVISE_SMOKE_REQUESTS
    sweep_dir = args.sweep
    if args.simulate:
        sweep_dir = out / "sweep"
        _simulated_sweep(args, sweep_dir / "runs", console)
    if args.smoke:
        sweep_dir = out / "sweep"
        for repeat in range(1, args.repeats + 1):
            folder = sweep_dir / f"repeat-{repeat}" if args.repeats > 1 else sweep_dir
            command_sweep(_advise_sweep_argv(args, folder), console)
    objectives = _objectives(args)
    points = advisor.load_points(sweep_dir, objectives)
    shapes = sorted({p.shape for p in points})
    layouts = {shape: advisor.layout_of(shape, args.deployments_dir) for shape in shapes}
    devices = {shape: layout.devices for shape, layout in layouts.items()}
    advice = advisor.advise(points, objectives, devices)
    target = DeployTarget(
        accelerator=args.target,
        model=args.model,
        rate=args.target_rate,
        devices=args.devices,
        devices_per_node=args.devices_per_node,
        device_gib=args.device_memory_gib,
    )
    # The model's weights against a device's memory size GPU engines only.
    shape = _model_dims(args.model, console) if args.target == "gpu" else None
    advisor.plan_for(advice, layouts, target, shape)
    slug = "".join(c if c.isalnum() else "-" for c in advice.workload).strip("-")
    yaml_path = args.yaml or args.deployments_dir / f"advised-{slug}.yaml"
    advisor.write_yaml(advice, args.deployments_dir, yaml_path, target)
    markdown, png = advisor.write_report(advice, out, yaml_path)
    console.print(markdown.read_text())
    console.print(f"YAML: {yaml_path}\nreport: {markdown}\nplot: {png}")
    return 0


def _objectives(args: argparse.Namespace) -> advisor.Objectives:
    return advisor.Objectives(
        ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else None,
        tpot_s=args.slo_tpot_ms / 1000 if args.slo_tpot_ms is not None else None,
        attainment=args.attainment,
    )


def _placement_search(args: argparse.Namespace, out: Path, console: Console) -> int:
    """Every placement of --devices on the profile's degrees, searched offline."""
    if args.target_rate is not None:
        raise ValueError(
            "--target-rate sizes a measured shape; a placement search (--simulate with"
            " --devices) finds the most a budget of devices serves"
        )
    objectives = _objectives(args)
    question = PlacementQuestion(
        profile=args.simulate,
        devices=args.devices,
        run=RunConfig(
            workload=_advised_workload(args),
            num_requests=args.num_requests or SEARCH_REQUESTS,
            warmup_requests=0,
            show_progress=False,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        ),
        objectives=objectives,
        shapes=tuple(args.shapes or placement.SEARCH_SHAPES),
        deployments_dir=args.deployments_dir,
        devices_per_node=args.devices_per_node,
        accelerator=args.target or "gpu",
        model=args.model,
        qps_start=args.qps_start,
        run_seconds=args.run_seconds,
    )
    slug = "".join(c if c.isalnum() else "-" for c in question.run.workload.label).strip("-")
    yaml_path = args.yaml or args.deployments_dir / f"advised-{slug}.yaml"
    advise_placement(question, out, yaml_path, console)
    return 0


def _advised_workload(args: argparse.Namespace) -> WorkloadConfig:
    """--workload, a trace, or --input-len/--output-len's fixed lengths."""
    name = args.workload
    if args.trace is not None:
        name = "recorded-replay" if args.trace == "recorded" else "T-burst-replay"
    elif args.input_len or args.output_len:
        name = "custom"
    return WorkloadConfig(
        name=name,
        input_len=args.input_len,
        output_len=args.output_len,
        trace=args.trace or "burstgpt",
        trace_file=args.trace_file,
    )


def _simulated_sweep(args: argparse.Namespace, runs_dir: Path, console: Console) -> None:
    """The smoke sweep's cells, each run offline on the profile (python -m loadgen
    simulate), written where a sweep writes its runs."""
    workload = WorkloadConfig(name=args.workload, trace=args.trace or "burstgpt")
    rates = [_rate(text) for text in str(args.qps).split(",")]

    async def cells() -> None:
        for shape in args.shapes:
            target = SimulatedTarget(str(args.deployments_dir / f"{shape}.yaml"), args.simulate)
            for qps in rates:
                config = RunConfig(
                    workload=workload,
                    qps=qps,
                    num_requests=args.num_requests,
                    warmup_requests=0,
                    shape=shape,
                    show_progress=False,
                    slo_ttft_ms=args.slo_ttft_ms,
                    slo_tpot_ms=args.slo_tpot_ms,
                )
                result = await simulate_run(config, target, console)
                console.print(f"{result.run_id}: {result.notes[0]}")
                write_run_json(result, runs_dir)

    run_event_loop(cells())


def _rate(text: str) -> float:
    return math.inf if text.strip() == "inf" else float(text)


def _advise_sweep_argv(args: argparse.Namespace, folder: Path) -> list[str]:
    argv = [
        "--shapes", ",".join(args.shapes), "--workloads", args.workload, "--qps", args.qps,
        "--num-requests", str(args.num_requests), "--warmup-requests", "2",
        "--out", str(folder), "--no-plots", "--no-progress",
        "--deployments-dir", str(args.deployments_dir),
    ]  # fmt: skip
    if args.trace:
        argv += ["--trace", args.trace]
    if args.trace_file:
        argv += ["--trace-file", str(args.trace_file)]
    return argv


def _model_dims(model: str | None, console: Console) -> ModelDims | None:
    """The model's heads and weight size, where its config.json can be read here."""
    if model is None:
        return None
    config = read_model_config(model)
    if config is None:
        console.print(f"{model}: no config.json here (nothing is downloaded); TP not sized")
        return None
    return model_dims(config)


def command_sweep(argv: list[str], console: Console) -> int:
    args = build_sweep_parser().parse_args(argv)
    _configure_logging(args.verbose)
    explicit = set(argv)
    workloads = args.workloads or list(SMOKE_WORKLOADS if args.smoke else STUDY_WORKLOADS)
    qps = args.qps
    if args.smoke:
        qps = qps if "--qps" in explicit else list(SMOKE_QPS)
        if "--num-requests" not in explicit:
            args.num_requests = SMOKE_REQUESTS
        if "--warmup-requests" not in explicit:
            args.warmup_requests = SMOKE_WARMUP_REQUESTS
        if args.trace is None and args.trace_file is None:
            args.trace = "burstgpt-synthetic"
    shapes = args.shapes if "--shapes" in explicit or not args.urls else list(args.urls)
    sweep_fields: dict[str, object] = {
        "shapes": shapes,
        "workloads": workloads,
        "qps": qps,
        "urls": args.urls,
        "launch_command": args.launch_command,
        "port": args.port,
        "ready_timeout_s": args.ready_timeout,
        "stop_timeout_s": args.stop_timeout,
        "figure_qps": args.figure_qps,
        "out_dir": _out_dir(args, "sweep"),
        "plots_per_run": not args.no_plots,
    }
    if args.deployments_dir is not None:
        sweep_fields["deployments_dir"] = args.deployments_dir
    sweep = SweepConfig.model_validate(sweep_fields)
    base = run_config(args, workload_config(args, workloads[0]), qps[0])
    exposition = _exposition(args, console)
    result = run_event_loop(run_sweep(sweep, base, console, exposition))
    for name, path in result.outputs.items():
        console.print(f"{name}: {path}")
    for shape, error in result.failures.items():
        console.print(f"[red]not measured: {shape}[/] ({error.splitlines()[0]})")
    return 1 if result.failures and not result.rows else 0


def command_demo(argv: list[str], console: Console) -> int:
    args = build_demo_parser().parse_args(argv)
    _configure_logging(False)
    options = DemoOptions(
        args.config,
        args.num_requests,
        args.rate,
        args.port,
        args.out,
        args.seed,
        args.launch_command,
        args.deployments_dir,
    )
    run_demo(options, console)
    return 0


def command_fake_server(argv: list[str], console: Console) -> int:
    args = build_fake_server_parser().parse_args(argv)
    run_fake_server(
        FakeServerConfig(
            host=args.host,
            port=args.port,
            model=args.model,
            max_model_len=args.max_model_len,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            tokens_per_chunk=args.tokens_per_chunk,
            reject_every=args.reject_every,
            reject_status=args.reject_status,
            shape=args.shape,
        )
    )
    return 0


def command_trace_stats(argv: list[str], console: Console) -> int:
    args = build_trace_stats_parser().parse_args(argv)
    _configure_logging(False)
    workload = workload_config(args, "T-general")
    trace = load_trace(workload)
    means = subset_means(trace, args.max_model_len)
    print_trace_stats(console, trace.source, len(trace), means, STUDY_MEANS)
    return 0


def build_simulate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m loadgen simulate"
    parser.description = (
        "A run's results without a server: the same workload, prompts and schedule, served"
        " offline in virtual time by the config's router decisions over simulated engines"
        " that keep a latency profile's time (python -m deployments.simulate)."
    )
    parser.add_argument("config", help="single, dp, pd, pd_always, auto, ... or a YAML path")
    parser.add_argument(
        "--latency-profile",
        required=True,
        help="a latency profile file or a shipped one (python -m loadgen profile --list);"
        " --profile is vLLM's flag for its torch profiler",
    )
    parser.add_argument(
        "--path-ms",
        type=float,
        default=0.0,
        help="what the serving path (HTTP, parsing, tokenization) costs each request before"
        " it is planned; virtual time has none of it (measure it with python -m loadgen"
        " profile against the path on zero-time engines)",
    )
    return parser


def command_simulate(argv: list[str], console: Console) -> int:
    args = build_simulate_parser().parse_args(argv)
    _configure_logging(args.verbose)
    vllm = resolve(args)
    workload = vllm.workload or workload_config(args, args.workload)
    if workload.is_trace:
        load_trace(workload)
    configs = [run_config(args, workload, qps, vllm.run_fields) for qps in args.qps]
    if workload.is_replay and len(configs) > 1:
        configs = configs[:1]
    target = SimulatedTarget(args.config, args.latency_profile, args.model, args.path_ms)
    out = _out_dir(args, "simulate")

    async def all_runs() -> list[RunResult]:
        return [await simulate_run(config, target, console) for config in configs]

    _report_runs(run_event_loop(all_runs()), out, args, vllm, console)
    return 0


def build_profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen profile",
        description="Measure one engine's step times over a grid (prefill lengths, decode"
        " batches and contexts) and fit a latency profile for simulated engines"
        " (engine.backend: simulated). Serve one engine alone while it measures.",
    )
    parser.add_argument("--list", action="store_true", help="list the shipped profiles")
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--model", help="default: the first model of GET /v1/models")
    parser.add_argument("--device", help="what the engine runs on, e.g. H100-SXM-80GB")
    parser.add_argument("--model-name", help="the profile's model; default: --model")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument(
        "--kv-bytes-per-token", type=int, help="the model's KV per token, all layers"
    )
    parser.add_argument(
        "--kv-capacity-tokens", type=int, help="default: vLLM's cache_config_info on /metrics"
    )
    parser.add_argument("--handover-gbps", type=float, default=1.0, help="PD: KV link rate, GB/s")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    grid = ProfileGrid()
    parser.add_argument(
        "--prompt-lengths", type=_int_list, default=grid.prompt_lengths, help="e.g. 16,256,1024"
    )
    parser.add_argument("--batches", type=_int_list, default=grid.batches, help="e.g. 1,4,16")
    parser.add_argument("--contexts", type=_int_list, default=grid.contexts, help="e.g. 64,512")
    parser.add_argument("--repeats", type=int, default=grid.repeats)
    parser.add_argument(
        "--baseline-samples",
        type=Path,
        help="the .samples.json of a profile run against the same serving path on engines"
        " that take no time (deployments.serve CONFIG --simulate with a zero profile): its"
        " lone-request TTFT is taken off each prefill measurement, so that a simulated"
        " engine behind that path does not pay it twice",
    )
    parser.add_argument("--out", type=Path, help="the profile's file (YAML)")
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def command_profile(argv: list[str], console: Console) -> int:
    args = build_profile_parser().parse_args(argv)
    _configure_logging(False)
    if args.list:
        for name in shipped_profiles():
            console.print(name)
        return 0
    if args.device is None or args.kv_bytes_per_token is None:
        raise ValueError("profile needs --device and --kv-bytes-per-token (or --list)")
    return run_event_loop(_profile(args, console))


async def _profile(args: argparse.Namespace, console: Console) -> int:
    base_url = args.base_url.rstrip("/")
    headers = request_headers()
    served = await served_models(base_url, headers)
    model = args.model or served[0][0]
    max_model_len = dict(served).get(model) or 8192
    target = ProfileTarget(base_url, model, headers)
    grid = ProfileGrid(args.prompt_lengths, args.batches, args.contexts, repeats=args.repeats)
    capacity = args.kv_capacity_tokens or await kv_capacity_tokens(target)
    if capacity is None:
        raise ValueError("the server's /metrics has no KV cache size: give --kv-capacity-tokens")
    console.print(f"measuring {model} at {base_url} ...")
    prefills, decodes = await measure(target, grid)
    baseline_note = ""
    if args.baseline_samples:
        prefills, path_s = without_path_cost(prefills, args.baseline_samples)
        baseline_note = f"; less the serving path's own TTFT ({path_s * 1e3:.2f} ms median)"
    when = datetime.now().strftime("%Y-%m-%d")
    profile = profile_from(
        prefills,
        decodes,
        source=f"fitted from python -m loadgen profile against {model} on {args.device}"
        f" ({when}; prompt lengths {list(grid.prompt_lengths)}, batches"
        f" {list(grid.batches)}, contexts {list(grid.contexts)}, {grid.repeats} repeats)"
        + baseline_note,
        device=args.device,
        model=args.model_name or model,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_capacity_tokens=capacity,
        handover_bytes_per_s=args.handover_gbps * 1e9,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    out = args.out or Path("results/profiles") / (
        f"{args.device}-{profile.model}-tp{args.tensor_parallel_size}"
        f"-pp{args.pipeline_parallel_size}.yaml".lower().replace("/", "-")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    save_samples(out.with_suffix(".samples.json"), prefills, decodes)
    console.print(profile_table(profile, prefills, decodes))
    console.print(f"profile: {out}")
    return 0


def command_report(argv: list[str], console: Console) -> int:
    args = build_report_parser().parse_args(argv)
    _configure_logging(False)
    for path in render_report(args.path, args.out):
        console.print(f"plot: {path}")
    return 0


COMMANDS = {
    "profile": command_profile,
    "simulate": command_simulate,
    "knee": command_knee,
    "advise": command_advise,
    "run": command_run,
    "sweep": command_sweep,
    "demo": command_demo,
    "fake-server": command_fake_server,
    "trace-stats": command_trace_stats,
    "report": command_report,
}


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    argv = normalize_flag_names(sys.argv[1:] if argv is None else argv)
    console = Console()
    command = "run"
    if argv and argv[0] in SUBCOMMANDS:
        command = argv.pop(0)
    raise_open_file_limit()
    try:
        check_top_level_packages()
        return COMMANDS[command](argv, console)
    except (
        RunError,
        LaunchError,
        TraceUnavailableError,
        ValueError,
        ValidationError,
        PackageConflictError,
    ) as error:
        console.print(f"[red]error:[/] {error}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
