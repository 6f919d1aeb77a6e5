"""Finding one local node's processes by the marker in their environment (no Ray)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from deployments.local_nodes import NODE_MARKER, marked_pids


@pytest.fixture
def marked() -> Iterator[dict[str, int]]:
    """Three sleeping processes of cluster 'c1', one per node role, and one of 'c10'."""
    started = {
        name: subprocess.Popen(["sleep", "30"], env=dict(os.environ, **{NODE_MARKER: value}))
        for name, value in (("w", "c1:w"), ("worker", "c1:worker"), ("head", "c1:head"),
                            ("other", "c10:w"))
    }  # fmt: skip
    # Popen returns once the child has exec'd: its environment is readable already.
    yield {name: process.pid for name, process in started.items()}
    for process in started.values():
        process.kill()
        process.wait()


def test_a_cluster_is_found_whole_and_a_node_by_its_exact_role(marked: dict[str, int]) -> None:
    assert marked_pids("c1") == {marked["w"], marked["worker"], marked["head"]}
    assert marked_pids("c1", "w") == {marked["w"]}  # not 'worker', whose role starts so
    assert marked_pids("c1", "worker") == {marked["worker"]}
    assert marked_pids("c10") == {marked["other"]}
    assert marked_pids("c2") == set()
