"""Engine backends by name (``engine.backend`` in the YAML): the class that hosts one
engine and speaks the router's protocol (``engines.protocol``). Built in: ``vllm``
(``engines.host.EngineHost``), ``simulated`` (``engines.simulated.host``: vLLM's
scheduling on a latency profile's time) and ``synthetic`` (``engines.synthetic``: tokens
as fast as steps allow). A new backend implements ``engines.contract.EngineBackend`` and
is registered
with ``@ENGINE_BACKENDS.register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.contract import EngineBackend
from splitserve.registry import Registry

if TYPE_CHECKING:
    from engines.settings import EngineSpec


# A backend's class, called with its engine's spec.
ENGINE_BACKENDS: Registry[Callable[[EngineSpec], EngineBackend]] = Registry(
    "engine backend",
    __name__,
    builtins=("engines.host", "engines.synthetic", "engines.simulated.host"),
)
