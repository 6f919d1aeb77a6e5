"""Fixtures of the deployments' tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import api_corpus
from tests.support.served_apps import ServedApps
from tests.support.shared_apps import SHAPES, shared_app


@pytest.fixture(scope="session")
def single_answers(
    request: pytest.FixtureRequest, served_apps: ServedApps, serve_logs: Path
) -> dict[str, Any]:
    """What single.yaml answers to every collected module's reference prompts, by module.

    A module that compares another shape with one engine defines
    ``single_reference(base_url)``, whose requests name single.yaml's model. All of them
    are asked at once, of the shapes' shared application (conftest.py ``shapes_app``),
    while it runs for the first of them, so that no later module starts it again only
    for its reference.
    """
    modules = {item.module for item in request.session.items if isinstance(item, pytest.Function)}
    askers = [m for m in modules if hasattr(m, "single_reference")]
    app = served_apps.get(str(shared_app(serve_logs, "shapes", SHAPES)))
    return {module.__name__: module.single_reference(app.base_url) for module in askers}


@pytest.fixture(scope="session")
def vllm_answers(bare_vllm_answers: dict[str, Any]) -> dict[str, Any]:
    """Bare `vllm serve`'s answers to the API corpus (tests/support/api_corpus.py), asked
    once (conftest.py ``bare_vllm_answers``); each shape's module compares its own with
    them while its application runs."""
    return bare_vllm_answers[api_corpus.__name__]
