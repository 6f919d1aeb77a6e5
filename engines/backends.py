"""Engine backends by name (``engine.backend`` in the YAML): the class that hosts one
engine and speaks the router's protocol (``engines.protocol``). Built in: ``vllm``
(``engines.host.EngineHost``) and ``synthetic`` (``engines.synthetic``). A new backend
is a class with EngineHost's calls (``submit``, ``abort``, ``deltas``, ``stats``,
``check_health``, ``close_streams``, ``shutdown``, ``dead``), constructed from an
``EngineSpec``, and ``@ENGINE_BACKENDS.register("name")`` on it.
"""

from __future__ import annotations

from typing import Any

from splitserve.registry import Registry

ENGINE_BACKENDS: Registry[type[Any]] = Registry(
    "engine backend", __name__, builtins=("engines.host", "engines.synthetic")
)
