"""Engine choice: how the router picks one engine of a pool for a request.

A policy is a class registered in ``ENGINE_CHOICES`` under the name configs use
(``router.replica_choice``), with a ``settings_model`` for its block under
``router.replica_choice_settings``. It gets only healthy engines and the prompt's
block hashes, and says why it chose as it did (the ``reason`` label of
``splitserve_replica_choices_total``). The built-in ones are in
``router/policies/engine_choices.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, NamedTuple, Protocol

from splitserve.config_base import StrictModel
from splitserve.registry import Registry

if TYPE_CHECKING:
    from router.pool.pooled_engine import PooledEngine
    from router.pool.prefix_index import PromptBlocks


class Choice(NamedTuple):
    engine: PooledEngine
    reason: str


class EngineChoice(Protocol):
    settings_model: ClassVar[type[StrictModel]]

    def __init__(self, settings: StrictModel) -> None: ...

    def choose(self, engines: list[PooledEngine], prompt: PromptBlocks) -> Choice: ...


ENGINE_CHOICES: Registry[type[EngineChoice]] = Registry(
    "engine choice", __name__, builtins=("router.policies.engine_choices",)
)


def make_engine_choice(name: str, settings: StrictModel) -> EngineChoice:
    return ENGINE_CHOICES.get(name)(settings)
