"""PD prefill policy: whether a prompt is computed on the prefill pool (remote) or on
the decode engine that will generate the answer (local).

A policy is a class registered in ``PREFILL_POLICIES`` under the name configs use
(``prefill_policy.name``), with a ``settings_model`` for the rest of the
``prefill_policy:`` block. It decides from numbers the dispatcher gathers
(``PrefillInputs``) and the QoS settings, without side effects, and says why (the
``reason`` label of ``splitserve_prefill_decisions_total``). The built-in ones
(``always``, ``never``, ``conditional``, ``cost``) are in ``router/policies/prefill_policies.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from splitserve.config_base import StrictModel
from splitserve.registry import Registry

if TYPE_CHECKING:
    from router.settings import Priority, QoSConfig

Where = Literal["local", "remote"]


@dataclass(frozen=True, slots=True)
class PrefillDecision:
    """Where a request's prompt is computed and why: ``remote`` (on a prefill engine, or
    in an auto pool on a peer, its KV then handed to the engine that generates) or
    ``local`` (on the engine that generates). A policy returns one per request; where a
    planned remote prefill cannot run, the PD flow reports the decision it fell back to
    (``fallen_back``) before the first token, so that what is counted and answered
    (``x-splitserve-prefill``) is where the prompt ran.

    ``whole_on_peer``: in an auto pool, for a remote decision whose peer would serve
    the whole request better than a remote prefill, the reason it then runs there (local)."""

    where: Where
    reason: str
    whole_on_peer: str | None = None

    @property
    def remote(self) -> bool:
        return self.where == "remote"

    def fallen_back(self, reason: str) -> PrefillDecision:
        """The planned remote prefill did not run: the generating engine computes it."""
        return PrefillDecision("local", reason)


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    """What the dispatcher knows about one prompt when it plans it.

    prompt_len: prompt tokens; prefix_cached_len: of those, expected in the decode
    engine's prefix cache; prefill_queue: prefills queued or running on the prefill
    engine that would take it; decode_active: requests active on the decode engine;
    prefill_active: requests active on the prefill engine (in an auto pool, the
    decodes a remote prefill would stall there); the two TTFT estimates count only the
    work queued ahead of this priority; transfer_s: the KV hand-over's expected time
    for this prompt, at the rate the object store measured (None until measured).
    """

    prompt_len: int
    prefix_cached_len: int
    prefill_queue: int
    decode_active: int
    priority: Priority
    # Estimated time to first token of this request, prefilled on the prefill engine or
    # on the decode engine (router/pool/engine_state.py); None until measured.
    remote_ttft_s: float | None = None
    local_ttft_s: float | None = None
    prefill_active: int = 0
    transfer_s: float | None = None


class PrefillPolicy(Protocol):
    settings_model: ClassVar[type[StrictModel]]

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None: ...

    def decide(self, inputs: PrefillInputs) -> PrefillDecision: ...


PREFILL_POLICIES: Registry[type[PrefillPolicy]] = Registry(
    "prefill policy", __name__, builtins=("router.policies.prefill_policies",)
)


def make_prefill_policy(name: str, settings: StrictModel, qos: QoSConfig) -> PrefillPolicy:
    return PREFILL_POLICIES.get(name)(settings, qos)
