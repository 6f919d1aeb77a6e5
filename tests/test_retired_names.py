"""One word per concept (docs/ARCHITECTURE.md's glossary), read from the source with
``ast`` as tests/test_import_boundaries.py reads imports: names that a rename retired
must not come back, and router code says "engine" for an engine, keeping "replica" for
Serve's replicas and for the public names that carry it (a YAML key, a metric, a
header), each listed here with why."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_import_boundaries import REPO, our_packages

# A retired identifier, and what says it now.
RETIRED = {
    "ReplicaState": "EngineState (router/pool/engine_state.py)",
    "replica_state": "engine_state",
    "EngineStatePoller": "EngineStatsPoller (router/pool/stats_poller.py)",
    "prefill_replica": "prefill_engine",
    "ReplicaChoice": "EngineChoice",
    "make_replica_choice": "make_engine_choice",
    "ConditionalSplit": "ConditionalPolicy (a prefill policy)",
    "CostSplit": "CostPolicy (a prefill policy)",
    "RequestObserver": "RequestMetrics, called by RequestLife (router/lifecycle.py)",
    "FrontendCall": "RequestLife (router/lifecycle.py)",
    "CURRENT_CALL": "the RequestLife vLLM's layer passes to generate",
    "fall_back": "PrefillDecision.fallen_back",
}
# Where "replica" is Serve's: a scaled pool's members are Serve replicas.
SERVE_REPLICA_MODULES = ("membership.py", "members.py", "watcher.py")
# Public names that keep "replica": YAML keys, metric families (named as their
# metrics), headers, Serve's own API.
PUBLIC_REPLICA_NAMES = {
    "replica_choice",  # YAML router.replica_choice
    "replica_choice_settings",  # YAML router.replica_choice_settings
    "replica_choices",  # splitserve_replica_choices_total
    "replica_requests",  # splitserve_replica_requests_total
    "replica_in_flight",  # splitserve_replica_in_flight_requests
    "REPLICA_HEADER",  # x-splitserve-replica
    "PREFILL_REPLICA_HEADER",  # x-splitserve-prefill-replica
    "get_replica_context",  # Serve's
    "replica_id",  # Serve's ReplicaContext
}


def identifiers(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """Every name the code defines or uses: variables, attributes, functions, classes,
    arguments, imported names, keywords."""
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            yield node.id, line
        elif isinstance(node, ast.Attribute):
            yield node.attr, line
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, line
        elif isinstance(node, ast.arg):
            yield node.arg, line
        elif isinstance(node, ast.alias):
            yield (node.asname or node.name).split(".")[-1], line
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg, line
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield from ((part, line) for part in node.module.split("."))


def _sources() -> Iterator[Path]:
    for top in (*our_packages(), "tests", "bench"):
        yield from sorted(path for path in (REPO / top).rglob("*.py") if path != Path(__file__))


def _names(path: Path) -> Iterator[tuple[str, int]]:
    return identifiers(ast.parse(path.read_text(), str(path)))


def test_no_retired_name_is_used() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {name} (now {RETIRED[name]})"
        for path in _sources()
        for name, line in _names(path)
        if name in RETIRED
    ]
    assert not found, "retired names:\n" + "\n".join(found)


def test_router_code_says_engine_for_an_engine() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in sorted((REPO / "router").rglob("*.py"))
        if path.name not in SERVE_REPLICA_MODULES
        for name, line in _names(path)
        if "replica" in name.lower() and name not in PUBLIC_REPLICA_NAMES
    ]
    assert not found, "'replica' in router code (an engine is an engine):\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("x = ReplicaState()\n", "ReplicaState"),
        ("def f(prefill_replica): pass\n", "prefill_replica"),
        ("a.fall_back('x')\n", "fall_back"),
        ("from router.pool.replica_state import X\n", "replica_state"),
        ("f(prefill_replica=1)\n", "prefill_replica"),
    ],
)
def test_the_scan_sees_each_kind_of_name(source: str, name: str) -> None:
    assert name in {found for found, _ in identifiers(ast.parse(source))}
