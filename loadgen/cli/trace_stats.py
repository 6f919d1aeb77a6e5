"""``python -m loadgen trace-stats``: a trace's subsets against the study's means."""

from __future__ import annotations

import argparse

from rich.console import Console

from loadgen.cli.common import (
    add_workload_options,
    configure_logging,
    workload_config,
)
from loadgen.data.burstgpt import (
    STUDY_MEANS,
    subset_means,
)
from loadgen.data.workloads import load_trace
from loadgen.outputs.report import (
    print_trace_stats,
)


def build_trace_stats_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen trace-stats",
        description="Rows and mean lengths of the BurstGPT subsets, next to the study's Table 2.",
    )
    add_workload_options(parser, single=False)
    parser.add_argument("--max-model-len", type=int, default=4096)
    return parser


def command_trace_stats(argv: list[str], console: Console) -> int:
    args = build_trace_stats_parser().parse_args(argv)
    configure_logging(False)
    workload = workload_config(args, "T-general")
    trace = load_trace(workload)
    means = subset_means(trace, args.max_model_len)
    print_trace_stats(console, trace.source, len(trace), means, STUDY_MEANS)
    return 0
