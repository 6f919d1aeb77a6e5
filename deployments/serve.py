"""``python -m deployments.serve pd``: serve an application the fast way, until Ctrl-C
or SIGTERM.

It is ``serve run deployments/pd.yaml`` on a Ray cluster started with Serve's direct
ingress (deployments.launcher.cluster_env): the router replica itself answers on the
port, and no token crosses Serve's proxy. A plain ``serve run`` serves the same
application through the proxy, a few milliseconds slower per request and per token
(bench/overhead.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

from deployments.launcher import (
    DEFAULT_PORT,
    cluster_env,
    config_path,
    serve_command,
    sigterm_unwinds,
    simulated_config,
    wait_replicas_gone,
    wait_until_bindable,
)
from splitserve.processes import SERVE_DEPLOY_FAILED, ChildSettings, stop_process

# How long `serve run` may take to stop the application after a failure or Ctrl-C.
STOP_TIMEOUT_S = 90.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__)
    parser.add_argument(
        "config",
        help="single, dp, tp, pp, pd, pd_always, auto, auto_scaled, models, or a YAML path",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="where the router listens")
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="serve the config on simulated engines that keep this latency profile's time:"
        " a profile file or a shipped profile (python -m loadgen profile --list)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="with --simulate: stretch every simulated time by this factor",
    )
    parser.add_argument(
        "--spend",
        choices=("wall", "cpu"),
        default="wall",
        help="with --simulate: sleep each step (a GPU's time), or compute it on the"
        " engine's cpu_binds cores (a CPU engine's time, sharing them as a real one does)",
    )
    args = parser.parse_args(argv)
    path = config_path(args.config)
    if not path.exists():
        parser.error(f"no such config: {path}")
    if args.simulate:
        path = simulated_config(path, args.simulate, args.time_scale, args.spend)
    if os.environ.get("RAY_ADDRESS"):
        # Serve reads these where the cluster starts, not here.
        settings = " ".join(f"{name}={value}" for name, value in cluster_env(args.port).items())
        print(f"using the cluster at RAY_ADDRESS; it must have been started with {settings}")
    wait_until_bindable(args.port)
    command, env = serve_command(path, args.port)
    with sigterm_unwinds():
        sys.exit(run_until_failed(command, env))


def run_until_failed(command: list[str], env: dict[str, str]) -> int:
    """Run ``serve run``, echoing what it prints, until it ends or prints a line that
    means the application will never come up (SERVE_DEPLOY_FAILED: a failed build, or
    an engine that cannot start, with vLLM's reason). ``serve run`` itself keeps
    running after those, while Serve restarts the same failure for ever; here the
    application is stopped and the exit status is 1."""
    # ChildSettings restores SIGINT, which a shell's background job starts ignored:
    # `serve run` must take the clean stop asked of it.
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ChildSettings(),
    )
    failures: list[str] = []
    ended = threading.Event()

    def echo() -> None:
        # Reads to the end, stop included, so a full pipe never stalls `serve run`.
        assert process.stdout is not None
        for line in process.stdout:
            sys.stdout.write(line)
            if not failures and any(marker in line for marker in SERVE_DEPLOY_FAILED):
                failures.append(line.strip())
                ended.set()
        ended.set()

    reader = threading.Thread(target=echo, name="serve-run-output", daemon=True)
    reader.start()
    try:
        ended.wait()
    except KeyboardInterrupt:
        # A terminal's Ctrl-C reached `serve run` too; it stops the application.
        _stop_serve_run(process, reader)
        return 128 + signal.SIGINT
    except SystemExit as stopped:  # SIGTERM (sigterm_unwinds): asked here
        _stop_serve_run(process, reader)
        raise stopped
    if not failures:
        return process.wait()
    print(f"\nerror: the application cannot come up: {failures[0]}", file=sys.stderr)
    _stop_serve_run(process, reader)
    return 1


def _stop_serve_run(process: subprocess.Popen[str], reader: threading.Thread) -> None:
    # Further signals must not cut this stop short: it is what they asked for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_process(process, STOP_TIMEOUT_S)
    reader.join(timeout=5)
    # On a cluster `serve run` did not start, its stop deletes the application and
    # returns while the replicas still exit; one that lingers would hold the port the
    # next application needs.
    left = wait_replicas_gone(timeout_s=STOP_TIMEOUT_S)
    if left:
        print(f"error: replicas {sorted(left)} outlived the application's stop", file=sys.stderr)


if __name__ == "__main__":
    main()
