"""``serve run deployments/auto_scaled.yaml``: an auto pool that Serve scales, answering
the API corpus as bare `vllm serve` does (the shipped shape the other parity tests do
not start). It is the ``auto_scaled`` model of the shapes' shared application
(tests/support/shared_apps.py): its pool, policies and autoscaling as shipped, one start
shared with the other shapes."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.launcher import RunningApp
from tests.support.api_corpus import assert_answers_as
from tests.support.shared_apps import SHAPES

pytestmark = pytest.mark.serving


def test_every_kind_of_request_is_answered_as_bare_vllm(
    shapes_app: RunningApp, vllm_answers: dict[str, Any]
) -> None:
    assert_answers_as(vllm_answers, shapes_app.base_url, SHAPES["auto_scaled"].name)
