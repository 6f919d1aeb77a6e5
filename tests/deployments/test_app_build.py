"""Serve's build step (``deployments.app:build_app``) runs at every start, before Serve's
proxy has the application's routes: under a plain ``serve run`` it answers 404 until the
build returns. The build names the replicas' classes by import path, so that it never
imports vLLM; these tests hold it to that and check what it hands Serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from deployments.app import ENGINE_REPLICA_CLASS, ROUTER_CLASS, build_app

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("vllm", "torch", "transformers", "router.ingress", "engines.host")


def test_the_build_step_imports_neither_vllm_nor_the_replicas() -> None:
    # A fresh interpreter: this test process has imported them for other tests.
    probe = (
        "import sys, yaml; from deployments.app import build_app;"
        " build_app(yaml.safe_load(open('deployments/pd.yaml'))['applications'][0]['args']);"
        f" print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_replicas_are_named_by_import_paths_that_resolve() -> None:
    args = yaml.safe_load((REPO / "deployments" / "dp.yaml").read_text())["applications"][0]
    args["args"].setdefault("router", {})["engine_in_router"] = False
    router = build_app(args["args"])
    engines = router._bound_deployment.init_args[2]  # the router's engines, by replica name
    assert router._bound_deployment.func_or_class == ROUTER_CLASS
    assert {app._bound_deployment.func_or_class for app in engines.values()} == {
        ENGINE_REPLICA_CLASS
    }
    for path in (ROUTER_CLASS, ENGINE_REPLICA_CLASS):
        module, name = path.rsplit(".", 1)
        assert isinstance(getattr(__import__(module, fromlist=[name]), name), type)
