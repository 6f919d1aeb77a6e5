"""API keys: who may call the router, at which priority, with how many requests waiting.

As ``vllm serve --api-key``: a client sends ``Authorization: Bearer <key>``; a missing
or wrong key gets 401, a key not allowed a route 403, both in OpenAI's error format.
Keys come from the ``auth:`` block (by environment variable name or as they are) and
from the environment (``SPLITSERVE_API_KEYS``, comma-separated, and vLLM's
``VLLM_API_KEY``), read in the router's process. With none, every route is open.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus

from fastapi.responses import JSONResponse

from router.http.errors import OpenAIError
from router.observation.metrics import ModelMetrics
from router.policies.fair_share import Flow
from router.policies.qos import Refusal, RefusalReason
from router.settings import PRIORITIES, ApiKeyConfig, AuthConfig, Priority, check_key_text

KEYS_ENV = "SPLITSERVE_API_KEYS"
VLLM_KEY_ENV = "VLLM_API_KEY"
AUTHORIZATION_HEADER = "authorization"
# Where Anthropic's clients send their key (its SDK, coding agents given a base URL).
API_KEY_HEADER = "x-api-key"
BEARER = "bearer"
ANONYMOUS = "anonymous"  # the client of a router without keys
KEY_QUEUE_FULL: RefusalReason = "key_queue_full"  # its own cap, beside admission's


def _sent_key(headers: Mapping[str, str]) -> str:
    """The key a request carries: ``Authorization: Bearer``'s, else ``x-api-key``'s."""
    scheme, _, token = (headers.get(AUTHORIZATION_HEADER) or "").strip().partition(" ")
    if scheme.lower() == BEARER and token.strip():
        return token.strip()
    return (headers.get(API_KEY_HEADER) or "").strip()


class AuthSetupError(ValueError):
    """Keys that cannot be used: an unset variable, a repeated key. Names the field."""


class Unauthorized(OpenAIError):
    """401, with the header that tells a client which credentials to send (RFC 6750)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.UNAUTHORIZED)

    def response(
        self, headers: dict[str, str] | None = None, anthropic: bool = False
    ) -> JSONResponse:
        return super().response({**(headers or {}), "WWW-Authenticate": "Bearer"}, anthropic)


@dataclass(frozen=True, slots=True)
class Client:
    """Who sent a request: the key's name (never the key) and what it may do."""

    name: str
    max_priority: Priority = "high"
    max_queued: int | None = None
    routes: frozenset[str] | None = None  # None: every route
    weight: float = 1.0  # its fair share's weight (router/policies/fair_share.py)

    @property
    def flow(self) -> Flow:
        return Flow(self.name, self.weight)

    def grant(self, requested: Priority) -> Priority:
        """The priority served: the one asked for, or this key's highest if it asked more."""
        if PRIORITIES.index(requested) < PRIORITIES.index(self.max_priority):
            return self.max_priority
        return requested


EVERYONE = Client(ANONYMOUS)


class QueueSlot:
    """One request of a key counted as waiting for its first token; released once,
    at its first token or however it ends before."""

    __slots__ = ("_name", "_waiting")

    def __init__(self, waiting: dict[str, int] | None = None, name: str = "") -> None:
        self._waiting = waiting
        self._name = name

    def release(self) -> None:
        if self._waiting is not None:
            self._waiting[self._name] -= 1
            self._waiting = None


class ApiKeys:
    """The keys a router accepts, each with its Client, and its open routes."""

    def __init__(
        self, keys: Mapping[str, Client], open_paths: frozenset[str], retry_after_s: int = 1
    ) -> None:
        # Keys are compared as SHA-256 digests: equal lengths, so compare_digest's time
        # says nothing about a key's length or its first differing character.
        self._digests = [(_digest(key), client) for key, client in keys.items()]
        self._open_paths = open_paths
        self._retry_after_s = retry_after_s
        self._waiting: dict[str, int] = {}

    @classmethod
    def from_settings(cls, config: AuthConfig, environ: Mapping[str, str] = os.environ) -> ApiKeys:
        """The configured keys and those in ``environ``; AuthSetupError names a key_env
        that is not set, or a key given twice."""
        keys: dict[str, Client] = {}
        named = zip(config.key_names(), config.keys, strict=True)
        for index, (name, key_config) in enumerate(named):
            _add(keys, _configured_key(key_config, index, environ), _client(name, key_config))
        for name, key in _environment_keys(environ):
            _add(keys, key, Client(name))
        return cls(keys, frozenset(config.open_paths), config.retry_after_s)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def key_names(self) -> list[str]:
        return [client.name for _, client in self._digests]

    def authenticate(self, headers: Mapping[str, str], route: str) -> Client:
        """The request's Client, or Unauthorized (401) / OpenAIError 403."""
        if not self._digests or route in self._open_paths:
            return EVERYONE
        token = _sent_key(headers)
        if not token:
            raise Unauthorized(
                "missing API key: send it as the header 'Authorization: Bearer <key>'"
                " (or 'x-api-key: <key>')"
            )
        client = self._find(token)
        if client is None:
            raise Unauthorized("invalid API key")
        if client.routes is not None and route not in client.routes:
            raise OpenAIError(
                f"the API key {client.name!r} may not call {route}", HTTPStatus.FORBIDDEN
            )
        return client

    def refusal(self, headers: Mapping[str, str], route: str) -> OpenAIError | None:
        """For routes that answer without a body to validate: the error, or None."""
        try:
            self.authenticate(headers, route)
        except OpenAIError as error:
            return error
        return None

    def admit(
        self, client: Client, requested: Priority, metrics: ModelMetrics
    ) -> tuple[Priority, QueueSlot | Refusal]:
        """The priority the client is served at (lowered to its key's highest, counted
        in ``metrics.priority_capped``) and its place in its key's queue, or the Refusal
        (429) of a key that already has ``max_queued`` requests waiting for a first
        token, for its model's lifecycle to count and raise."""
        granted = client.grant(requested)
        if granted != requested:
            metrics.priority_capped.labels(client.name, requested, granted).inc()
        return granted, self._enqueue(client)

    def _enqueue(self, client: Client) -> QueueSlot | Refusal:
        cap = client.max_queued
        if cap is None:
            return QueueSlot()
        waiting = self._waiting.get(client.name, 0)
        if waiting >= cap:
            return Refusal(
                KEY_QUEUE_FULL,
                f"the API key {client.name!r} already has {waiting} requests waiting for"
                " their first token, its cap; retry when one has started",
                self._retry_after_s,
            )
        self._waiting[client.name] = waiting + 1
        # Given back at the first token or when the request's life ends, if not before.
        return QueueSlot(self._waiting, client.name)

    def waiting(self, name: str) -> int:
        return self._waiting.get(name, 0)

    def _find(self, token: str) -> Client | None:
        digest = _digest(token)
        found = None
        for key_digest, client in self._digests:  # every key, match or not: same time
            if hmac.compare_digest(digest, key_digest) and found is None:
                found = client
        return found


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _client(name: str, config: ApiKeyConfig) -> Client:
    routes = frozenset(config.routes) if config.routes is not None else None
    return Client(name, config.max_priority, config.max_queued, routes, config.weight)


def _configured_key(config: ApiKeyConfig, index: int, environ: Mapping[str, str]) -> str:
    if config.key is not None:
        return config.key.get_secret_value()
    where = f"auth.keys[{index}].key_env"
    key = environ.get(config.key_env or "", "")
    if not key:
        raise AuthSetupError(
            f"{where}: the environment variable {config.key_env} is not set (or empty) in"
            " the router's process"
        )
    _check(key, where)
    return key


def _environment_keys(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, key) of the keys in SPLITSERVE_API_KEYS (comma-separated) and VLLM_API_KEY."""
    found = []
    listed = [key.strip() for key in environ.get(KEYS_ENV, "").split(",")]
    for index, key in enumerate(key for key in listed if key):
        found.append((f"{KEYS_ENV}[{index}]", key))
    if environ.get(VLLM_KEY_ENV):
        found.append((VLLM_KEY_ENV, environ[VLLM_KEY_ENV].strip()))
    for name, key in found:
        _check(key, name)
    return found


def _check(key: str, where: str) -> None:
    try:
        check_key_text(key)
    except ValueError as error:
        raise AuthSetupError(f"{where}: {error}") from None


def _add(keys: dict[str, Client], key: str, client: Client) -> None:
    if key in keys:
        raise AuthSetupError(
            f"{client.name} holds the same key as {keys[key].name}: give each its own"
        )
    keys[key] = client


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def check_exposure(
    keys: ApiKeys, http_host: str | None, allow_open: bool, logger: logging.Logger
) -> None:
    """Refuse to start a router without keys that listens beyond this machine, unless the
    YAML says ``auth.allow_open: true``: an open port on a node's address is a decision,
    not a default."""
    if keys.enabled:
        logger.info("API keys required (open routes aside): %s", ", ".join(keys.key_names()))
        return
    if http_host is None or is_loopback(http_host):
        return
    if not allow_open:
        raise AuthSetupError(
            f"Serve listens on {http_host} and no API keys are configured: anyone who can"
            f" reach this host could use every route. Set auth.keys in the YAML or {KEYS_ENV},"
            " bind http_options.host: 127.0.0.1, or set auth.allow_open: true to serve"
            " openly on purpose"
        )
    logger.warning(
        "no API keys and Serve listens on %s: every route is open (auth.allow_open)", http_host
    )
