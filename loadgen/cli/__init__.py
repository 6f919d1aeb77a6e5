"""``python -m loadgen``: one module per subcommand (run, sweep, knee, advise, demo,
fake-server, trace-stats, report, profile, simulate), each with its parser and its
command; what they share is in ``common``."""

from __future__ import annotations

import sys

from pydantic import ValidationError
from rich.console import Console

from loadgen.cli.advise import command_advise
from loadgen.cli.common import raise_open_file_limit
from loadgen.cli.demo import command_demo
from loadgen.cli.fake_server import command_fake_server
from loadgen.cli.knee import command_knee
from loadgen.cli.profile import command_profile
from loadgen.cli.report import command_report
from loadgen.cli.run import build_parser, command_run
from loadgen.cli.simulate import command_simulate
from loadgen.cli.sweep import command_sweep
from loadgen.cli.trace_stats import command_trace_stats
from loadgen.data.burstgpt import TraceUnavailableError
from loadgen.scheduling.runner import RunError
from loadgen.study.launcher import LaunchError
from loadgen.vllm_compat.cli import normalize_flag_names
from splitserve.packaging import PackageConflictError, check_top_level_packages

__all__ = ["build_parser", "main"]


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
