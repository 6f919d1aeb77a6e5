"""PD split policy: whether a prompt is computed on the prefill pool (remote) or on
the decode replica that will generate the answer (local).

A policy is a class registered in ``SPLIT_POLICIES`` under the name configs use
(``split_policy.mode``), with a ``settings_model`` for the rest of the
``split_policy:`` block. It decides from numbers the dispatcher gathers
(``SplitInputs``) and the QoS settings, without side effects, and says why (the
``reason`` label of ``splitserve_prefill_decisions_total``). The built-in ones
(``always``, ``never``, ``conditional``, ``cost``) are in ``router/policies/split_policies.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple, Protocol

from splitserve.config_base import StrictModel
from splitserve.registry import Registry

if TYPE_CHECKING:
    from router.settings import Priority, QoSConfig

Where = Literal["local", "remote"]


class SplitDecision(NamedTuple):
    where: Where
    reason: str

    @property
    def remote(self) -> bool:
        return self.where == "remote"


@dataclass(frozen=True, slots=True)
class SplitInputs:
    """What the dispatcher knows about one prompt when it plans it.

    prompt_len: prompt tokens; prefix_cached_len: of those, expected in the decode
    replica's prefix cache; prefill_queue: prefills queued or running on the prefill
    replica that would take it; decode_active: requests active on the decode replica;
    prefill_active: requests active on the prefill replica (in a role-free pool, the
    decodes a remote prefill would stall there); the two TTFT estimates count only the
    work queued ahead of this priority; transfer_s: the KV hand-over's expected time
    for this prompt, at the rate the object store measured (None until measured).
    """

    prompt_len: int
    prefix_cached_len: int
    prefill_queue: int
    decode_active: int
    priority: Priority
    # Estimated time to first token of this request, prefilled on the prefill replica or
    # on the decode replica (router/pool/replica_state.py); None until measured.
    remote_ttft_s: float | None = None
    local_ttft_s: float | None = None
    prefill_active: int = 0
    transfer_s: float | None = None


class SplitPolicy(Protocol):
    settings_model: ClassVar[type[StrictModel]]

    def __init__(self, settings: StrictModel, qos: QoSConfig) -> None: ...

    def decide(self, inputs: SplitInputs) -> SplitDecision: ...


SPLIT_POLICIES: Registry[type[SplitPolicy]] = Registry(
    "split policy", __name__, builtins=("router.policies.split_policies",)
)


def make_split_policy(mode: str, settings: StrictModel, qos: QoSConfig) -> SplitPolicy:
    return SPLIT_POLICIES.get(mode)(settings, qos)
