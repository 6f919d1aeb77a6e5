"""Fixtures of the deployments' tests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.served_apps import ServedApps


@pytest.fixture(scope="session")
def single_answers(request: pytest.FixtureRequest, served_apps: ServedApps) -> dict[str, Any]:
    """What single.yaml answers to every collected module's reference prompts, by module.

    A module that compares another strategy with one engine defines
    ``single_reference(base_url)``. All of them are asked at once, while single.yaml
    runs for the first of them, so no later module starts single.yaml again (about a
    minute and a half each) only for its reference.
    """
    modules = {item.module for item in request.session.items if item.module is not None}
    askers = [m for m in modules if hasattr(m, "single_reference")]
    app = served_apps.get("single")
    return {module.__name__: module.single_reference(app.base_url) for module in askers}
