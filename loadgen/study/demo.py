"""The main job in one command: start a Serve application, put a BurstGPT-shaped load
on it, print the table and where the plots are, stop it.

    python -m loadgen demo                 # deployments/pd.yaml
    python -m loadgen demo --config dp     # any deployments/<name>.yaml

The load is the BurstGPT-shaped generator's trace replayed at its own bursty pace
(``T-burst-replay``, labelled synthetic), sped up to about ``DEMO_RATE`` requests/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from loadgen.config import RunConfig, WorkloadConfig
from loadgen.data.burstgpt import BURSTGPT_MEAN_RATE
from loadgen.outputs.report import (
    plot_run,
    print_run_table,
    summary_row,
    write_run_json,
    write_summary_csv,
)
from loadgen.scheduling.eventloop import run_event_loop
from loadgen.scheduling.runner import execute_run
from loadgen.study.launcher import (
    DEFAULT_DEPLOYMENTS_DIR,
    LaunchError,
    command_from_template,
    launched_server,
    serve_run_command,
)
from loadgen.vllm_compat.result import write_vllm_result

DEMO_CONFIG = "pd"
DEMO_REQUESTS = 60
DEMO_RATE = 2.0  # requests/s on average; the replay keeps the trace's bursts
DEMO_PORT = 8000


@dataclass(frozen=True)
class DemoOptions:
    config: str = DEMO_CONFIG
    num_requests: int = DEMO_REQUESTS
    rate: float = DEMO_RATE
    port: int = DEMO_PORT
    out_dir: Path = Path("results/loadgen/demo")
    seed: int = 0
    launch_command: str | None = None  # instead of serve run: {config} {port} placeholders
    deployments_dir: Path = DEFAULT_DEPLOYMENTS_DIR  # where <config>.yaml is


def run_demo(options: DemoOptions, console: Console) -> Path:
    """Returns the path of the run's plot."""
    config_path = options.deployments_dir / f"{options.config}.yaml"
    if options.launch_command:
        command = command_from_template(
            options.launch_command, shape=options.config, config=config_path, port=options.port
        )
    elif config_path.exists():
        command = serve_run_command(config_path, options.port)
    else:
        raise LaunchError(f"no {config_path}; pick another with --config (single, dp, tp, pp)")
    base_url = f"http://127.0.0.1:{options.port}"
    console.print(f"starting [bold]{' '.join(command)}[/] (about a minute on a CPU)")
    with launched_server(command, base_url, options.out_dir / f"serve-{options.config}.log"):
        console.print(f"[green]serving[/] at {base_url}; sending {options.num_requests} requests")
        config = RunConfig(
            base_url=base_url,
            workload=WorkloadConfig(
                name="T-burst-replay",
                trace="burstgpt-synthetic",
                time_scale=BURSTGPT_MEAN_RATE / options.rate,
            ),
            num_requests=options.num_requests,
            shape=options.config,
            seed=options.seed,
        )
        result = run_event_loop(execute_run(config, console))
        console.print("stopping the application and its engines...")
    print_run_table(console, [result])
    json_path = write_run_json(result, options.out_dir)
    write_vllm_result(result, options.out_dir)
    write_summary_csv([summary_row(result)], options.out_dir / "summary.csv")
    plot_path = plot_run(result, options.out_dir / f"{result.run_id}.png")
    console.print(f"every request: {json_path}")
    console.print(f"[bold]plots: {plot_path}[/]")
    return plot_path
