"""``serve run deployments/auto_scaled.yaml``: an auto pool that Serve
scales, answering the API corpus as bare `vllm serve` does (the shipped shape the
other parity tests do not start)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api_corpus import assert_answers_as
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving


def test_every_kind_of_request_is_answered_as_bare_vllm(
    served_apps: ServedApps, vllm_answers: dict[str, Any]
) -> None:
    app = served_apps.get("auto_scaled")
    assert_answers_as(vllm_answers, app.base_url)
