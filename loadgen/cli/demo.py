"""``python -m loadgen demo``: the main job on the embedded model."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from loadgen.cli.common import (
    RESULTS_ROOT,
    configure_logging,
)
from loadgen.study.demo import DEMO_CONFIG, DEMO_RATE, DEMO_REQUESTS, DemoOptions, run_demo
from loadgen.study.launcher import DEFAULT_DEPLOYMENTS_DIR


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


def command_demo(argv: list[str], console: Console) -> int:
    args = build_demo_parser().parse_args(argv)
    configure_logging(False)
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
