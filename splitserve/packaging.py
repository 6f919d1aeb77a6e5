"""Our top-level package names are plain words (``router``, ``engines``, ...): make sure
the ones imported are ours.

What happens otherwise, checked with pip 23 and setuptools' editable installs: pip
installs two distributions with the same top-level package into one folder without a
word, the second overwriting the files they share; and our editable install (``make
setup``) finds its packages through a finder that Python consults after
site-packages, so another distribution's ``router`` there shadows ours entirely.
Either way the failure would be an ImportError or wrong behaviour far from its cause,
so the entry points (the application builder, the load generator) call
``check_top_level_packages`` first and refuse to start with the names involved.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

DISTRIBUTION = "splitserve"
TOP_LEVEL_PACKAGES = (
    "splitserve",
    "deployments",
    "engines",
    "router",
    "kv_transfer",
    "loadgen",
    "dashboards",
)
_HOME = Path(__file__).resolve().parent.parent


class PackageConflictError(ImportError):
    """Another distribution provides (or shadows) one of our top-level packages."""


def foreign_owners(packages: tuple[str, ...] = TOP_LEVEL_PACKAGES) -> dict[str, list[str]]:
    """Installed distributions other than ours that declare one of ``packages``."""
    owners = importlib.metadata.packages_distributions()
    found: dict[str, list[str]] = {}
    for package in packages:
        others = sorted({d for d in owners.get(package, ()) if d.lower() != DISTRIBUTION})
        if others:
            found[package] = others
    return found


def shadowed(packages: tuple[str, ...] = TOP_LEVEL_PACKAGES) -> dict[str, str]:
    """Packages whose import would load a folder other than ours, with that folder."""
    found: dict[str, str] = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        origin = (
            spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
        )
        if origin is None or Path(origin).resolve() != _HOME / package:
            found[package] = str(origin)
    return found


def check_top_level_packages() -> None:
    """Raise PackageConflictError naming every conflict; return quietly when none."""
    problems = [
        f"  - {package!r} is also provided by {', '.join(others)}"
        for package, others in foreign_owners().items()
    ]
    problems += [
        f"  - 'import {package}' loads {origin}, not {_HOME / package}"
        for package, origin in shadowed().items()
    ]
    if problems:
        raise PackageConflictError(
            "splitserve's top-level packages clash with another installation:\n"
            + "\n".join(problems)
            + "\ninstall splitserve into a virtualenv of its own (make setup does)"
        )
