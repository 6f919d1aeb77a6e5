"""Our plainly named top-level packages are ours, or the entry points refuse to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.packaging import (
    PackageConflictError,
    check_top_level_packages,
    foreign_owners,
)

REPO = Path(__file__).resolve().parents[2]


def test_this_environment_has_no_conflict() -> None:
    check_top_level_packages()


def _fake_distribution(folder: Path, name: str, top_level: str) -> None:
    info = folder / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{top_level}\n")


def test_another_distribution_declaring_router_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_distribution(tmp_path, "other-router", "router")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert foreign_owners()["router"] == ["other-router"]
    with pytest.raises(PackageConflictError, match="'router' is also provided by other-router"):
        check_top_level_packages()


def test_a_foreign_router_first_on_the_path_is_named(tmp_path: Path) -> None:
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "__init__.py").write_text("")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from splitserve.packaging import check_top_level_packages as check; check()"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert f"'import router' loads {tmp_path / 'router'}" in done.stderr


def test_registries_pickle_by_reference() -> None:
    """Ray pickles some classes by value with the globals they use; a registry among
    them must arrive as the receiving process's own, not a frozen copy."""
    import pickle

    from engines.backends import ENGINE_BACKENDS
    from kv_transfer.backend_registry import KV_BACKENDS
    from loadgen.config import ARRIVALS, WORKLOADS
    from router.policies.engine_choice import ENGINE_CHOICES
    from router.policies.prefill_policy import PREFILL_POLICIES

    for registry in (ENGINE_BACKENDS, KV_BACKENDS, ARRIVALS, WORKLOADS, PREFILL_POLICIES,
                     ENGINE_CHOICES):  # fmt: skip
        assert pickle.loads(pickle.dumps(registry)) is registry
