"""``python -m deployments.serve pd``: serve an application the fast way, until Ctrl-C.

It is ``serve run deployments/pd.yaml`` on a Ray cluster started with Serve's direct
ingress (deployments.launcher.cluster_env): the router replica itself answers on the
port, and no token crosses Serve's proxy. A plain ``serve run`` serves the same
application through the proxy, a few milliseconds slower per request and per token
(bench/overhead.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from deployments.launcher import (
    DEFAULT_PORT,
    cluster_env,
    config_path,
    serve_command,
    wait_until_bindable,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__)
    parser.add_argument(
        "config", help="single, dp, tp, pp, pd, pd_always, auto, auto_scaled, or a YAML path"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="where the router listens")
    args = parser.parse_args(argv)
    path = config_path(args.config)
    if not path.exists():
        parser.error(f"no such config: {path}")
    if os.environ.get("RAY_ADDRESS"):
        # Serve reads these where the cluster starts, not here.
        settings = " ".join(f"{name}={value}" for name, value in cluster_env(args.port).items())
        print(f"using the cluster at RAY_ADDRESS; it must have been started with {settings}")
    wait_until_bindable(args.port)
    command, env = serve_command(path, args.port)
    sys.stdout.flush()
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
