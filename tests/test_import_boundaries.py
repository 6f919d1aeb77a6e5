"""The package boundaries the docs draw, read from the source with ``ast``: nothing is
imported, so this is fast and names the file and line of each offending import.

- docs/ARCHITECTURE.md: ``deployments/`` is the composition root, "imported by no other
  package"; ``router/`` "never" imports it. Only ``deployments/`` itself, ``tests/`` and
  ``bench/`` may. Everything else reaches it as an entry point, not an import: Serve
  through the YAMLs' ``import_path``, people through ``python -m deployments.serve``,
  and the load generator's sweep by running that command (loadgen/study/launcher.py).
- docs/ARCHITECTURE.md: ``loadgen/`` "imports only splitserve/" of our packages; README:
  it "imports nothing from the server packages", so neither does what it imports of
  ``splitserve/``. docs/DECISIONS.md: "``loadgen`` never imports vLLM", and it "loads
  no tokenizer".

Every import counts: at module level, inside functions, under ``TYPE_CHECKING``, and
modules named to ``importlib.import_module`` or a registry's ``builtins``.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVER_PACKAGES = ("deployments", "router", "engines", "kv_transfer")
# May import deployments/: the composition root itself, and what is not shipped.
DEPLOYMENTS_IMPORTERS = ("deployments", "tests", "bench")
# Third-party packages the load generator never loads (docs/DECISIONS.md).
NOT_FOR_LOADGEN = ("vllm", "transformers", "tokenizers")


@dataclass(frozen=True)
class Import:
    path: Path  # relative to the repository
    line: int
    module: str  # absolute, dotted

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


@cache
def our_packages() -> tuple[str, ...]:
    """The top-level packages pyproject.toml ships (``[tool.setuptools.packages.find]``)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    return tuple(sorted({pattern.rstrip("*").rstrip(".") for pattern in include}))


def modules_of(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of a top-level package."""
    for path in sorted((REPO / package).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


@cache
def module_files() -> dict[str, Path]:
    return {name: path for package in our_packages() for name, path in modules_of(package)}


@cache
def imports_of(path: Path) -> tuple[Import, ...]:
    return parse_imports(path.read_text(), path.relative_to(REPO))


def parse_imports(source: str, relative: Path) -> tuple[Import, ...]:
    """Every module the file at ``relative`` imports, absolute; ``from a import b`` also
    names ``a.b`` when that is a module of ours."""
    package_parts = relative.parent.parts
    tree = ast.parse(source, str(relative))
    found: list[Import] = []

    def add(node: ast.AST, module: str) -> None:
        found.append(Import(relative, getattr(node, "lineno", 0), module))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            add(node, module)
            for alias in node.names:
                if f"{module}.{alias.name}" in module_files():
                    add(node, f"{module}.{alias.name}")
        elif isinstance(node, ast.Call):
            for name in _named_modules(node):
                add(node, name)
    return tuple(found)


def _named_modules(call: ast.Call) -> list[str]:
    """Modules a call imports by name: ``importlib.import_module("a.b")`` and
    ``Registry(..., builtins=("a.b", ...))`` (splitserve/registry.py)."""
    function = call.func
    called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
    values: list[ast.expr] = []
    if called == "import_module" and call.args:
        values = [call.args[0]]
    elif called == "Registry":
        for keyword in call.keywords:
            if keyword.arg == "builtins" and isinstance(keyword.value, ast.Tuple | ast.List):
                values = list(keyword.value.elts)
    return [v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def _with_parents(module: str) -> Iterator[str]:
    """Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``."""
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        yield ".".join(parts[:end])


def test_the_scan_sees_every_package() -> None:
    assert set(SERVER_PACKAGES) | {"loadgen", "splitserve"} <= set(our_packages())
    for package in our_packages():
        assert any(True for _ in modules_of(package)), package
    assert sum(1 for _ in modules_of("loadgen")) >= 10
    # The scan finds imports of every kind it claims to.
    found = {i.module for i in imports_of(REPO / "router" / "policies" / "prefill_policy.py")}
    assert "router.policies.prefill_policies" in found  # a registry's builtins


def test_only_deployments_tests_and_bench_import_deployments() -> None:
    offenders = [
        str(found)
        for package in our_packages()
        if package not in DEPLOYMENTS_IMPORTERS
        for _, path in modules_of(package)
        for found in imports_of(path)
        if found.top == "deployments"
    ]
    assert not offenders, "deployments/ is imported by no other package:\n" + "\n".join(offenders)


def test_loadgen_imports_only_splitserve_of_our_packages() -> None:
    ours = set(our_packages())
    offenders = [
        str(found)
        for _, path in modules_of("loadgen")
        for found in imports_of(path)
        if found.top in ours - {"loadgen", "splitserve"}
    ]
    assert not offenders, "loadgen/ imports only splitserve/:\n" + "\n".join(offenders)


def test_loadgen_reaches_no_server_package_and_no_vllm() -> None:
    """Through everything it imports of ours, transitively."""
    reached: dict[str, Import | None] = {name: None for name, _ in modules_of("loadgen")}
    pending = list(reached)
    offenders: list[str] = []
    while pending:
        path = module_files()[pending.pop()]
        for found in imports_of(path):
            if found.top in SERVER_PACKAGES or found.top in NOT_FOR_LOADGEN:
                offenders.append(f"{found}{_chain(reached, found)}")
                continue
            for module in _with_parents(found.module):
                if module in module_files() and module not in reached:
                    reached[module] = found
                    pending.append(module)
    assert not offenders, "loadgen/ reaches what it must not:\n" + "\n".join(offenders)
    assert any(name.startswith("splitserve") for name in reached)  # the walk left loadgen/


def _chain(reached: dict[str, Import | None], found: Import) -> str:
    """`` (via a.py:3 imports b, ...)`` back to loadgen/, for a transitive offender."""
    steps: list[str] = []
    module = ".".join(found.path.with_suffix("").parts).removesuffix(".__init__")
    while (step := reached.get(module)) is not None:
        steps.append(str(step))
        module = ".".join(step.path.with_suffix("").parts).removesuffix(".__init__")
    return f" (via {'; '.join(steps)})" if steps else ""


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import deployments.config\n", {"deployments.config"}),
        ("from deployments import app\n", {"deployments", "deployments.app"}),
        ("def f():\n    from deployments.launcher import serve_run\n", {"deployments.launcher"}),
        ("if TYPE_CHECKING:\n    import deployments\n", {"deployments"}),
        (
            "import importlib\nimportlib.import_module('deployments.app')\n",
            {"importlib", "deployments.app"},
        ),
        ("R = Registry('x', __name__, builtins=('deployments.app',))\n", {"deployments.app"}),
        ("from . import settings\n", {"router.sub"}),  # no such module
        ("from .. import settings\n", {"router", "router.settings"}),
        ("from ..settings import RouterSettings\n", {"router.settings"}),
    ],
)
def test_every_kind_of_import_is_seen(source: str, expected: set[str]) -> None:
    where = Path("router/sub/probe.py")  # a module one package below router/
    found = parse_imports(source, where)
    assert {i.module for i in found} == expected
    assert all(i.path == where and i.line > 0 for i in found)


def test_engines_and_router_know_no_kv_handle_format() -> None:
    """The KV backend owns both sides of the hand-over: engine hosts and the router call
    its KVEngineSide and KVRouterSide, never the object-store backend's handle module."""
    offenders = [
        str(found)
        for package in ("engines", "router")
        for _, path in modules_of(package)
        for found in imports_of(path)
        if found.module.startswith(("kv_transfer.handle", "kv_transfer.object_store.directory"))
    ]
    assert not offenders, "the KV handle format stays in kv_transfer/:\n" + "\n".join(offenders)
