"""``python -m loadgen`` (``run``): one run, as vLLM's benchmark client would make it."""

from __future__ import annotations

import argparse

from rich.console import Console

from loadgen.cli.common import (
    add_load_options,
    add_report_options,
    add_run_target_options,
    add_workload_options,
    configure_logging,
    exposition_of,
    out_dir,
    report_runs,
    run_config,
    workload_config,
)
from loadgen.data.workloads import load_trace
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.scheduling.runner import RunResult, execute_run
from loadgen.vllm_compat.cli import (
    add_vllm_options,
    resolve,
)

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen",
        description="Load an OpenAI-compatible endpoint with the study's workloads or the"
        " BurstGPT trace at set rates; report TTFT, ITL, E2E, throughput and goodput.",
        epilog=RUN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_target_options(parser)
    add_workload_options(parser)
    add_load_options(parser, "inf")
    add_report_options(parser)
    add_vllm_options(parser)
    return parser


def command_run(argv: list[str], console: Console) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
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
    out = out_dir(args, "run")
    exposition = exposition_of(args, console)

    async def all_runs() -> list[RunResult]:
        return [await execute_run(config, console, exposition) for config in configs]

    report_runs(run_event_loop(all_runs()), out, args, vllm, console)
    return 0
