"""Our vLLM general plugin (entry point ``vllm.general_plugins`` → ``splitserve``).

vLLM calls ``register()`` early in every process it starts (front end, engine core,
workers). It repairs pipeline parallelism on the CPU platform and, in engines that a
splitserve replica hosts, ends the process when that replica is gone.
"""

from __future__ import annotations

from engines.cpu_pp_repair import install as install_cpu_pp_repair
from engines.orphan_guard import start_orphan_guard


def register() -> None:
    install_cpu_pp_repair()
    start_orphan_guard()
