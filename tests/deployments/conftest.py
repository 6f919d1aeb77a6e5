"""Fixtures of the deployments' tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import api_corpus
from tests.support.bare_vllm import bare_vllm
from tests.support.served_apps import ServedApps


@pytest.fixture(scope="session")
def single_answers(request: pytest.FixtureRequest, served_apps: ServedApps) -> dict[str, Any]:
    """What single.yaml answers to every collected module's reference prompts, by module.

    A module that compares another shape with one engine defines
    ``single_reference(base_url)``. All of them are asked at once, while single.yaml
    runs for the first of them, so no later module starts single.yaml again (about a
    minute and a half each) only for its reference.
    """
    modules = {item.module for item in request.session.items if item.module is not None}
    askers = [m for m in modules if hasattr(m, "single_reference")]
    app = served_apps.get("single")
    return {module.__name__: module.single_reference(app.base_url) for module in askers}


@pytest.fixture(scope="session")
def vllm_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Bare `vllm serve`'s answers to the API corpus (tests/support/api_corpus.py), asked
    once; each shape's module compares its own with them while its application runs."""
    with bare_vllm(tmp_path_factory.mktemp("bare-vllm")) as url:
        return api_corpus.answers(url)
