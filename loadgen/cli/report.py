"""``python -m loadgen report``: a report of saved runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from loadgen.cli.common import (
    configure_logging,
)
from loadgen.outputs.panels import render_report  # its ReportError is a ValueError


def build_report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadgen report",
        description="Render the dashboard's key panels as PNG from a run's JSON, a folder of"
        " runs, or a sweep's output folder (its figures from sweep.csv, plus every run).",
    )
    parser.add_argument("path", type=Path, help="RUN.json, or a run/sweep output folder")
    parser.add_argument("--out", type=Path, default=None, help="default: beside the input")
    return parser


def command_report(argv: list[str], console: Console) -> int:
    args = build_report_parser().parse_args(argv)
    configure_logging(False)
    for path in render_report(args.path, args.out):
        console.print(f"plot: {path}")
    return 0
