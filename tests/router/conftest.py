"""Fixtures of the router's tests."""

from __future__ import annotations

import pytest

from router.http.auth import KEYS_ENV, VLLM_KEY_ENV


@pytest.fixture(autouse=True)
def no_environment_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """API keys in this process's environment would close every route of a router this
    test starts; tests of keys set their own."""
    for name in (KEYS_ENV, VLLM_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
