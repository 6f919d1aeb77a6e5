"""Our vLLM general plugin (entry point ``vllm.general_plugins`` → ``splitserve``).

vLLM calls ``register()`` early in every process it starts (front end, engine core,
workers). It repairs pipeline parallelism on the CPU platform, in engines that a
splitserve replica hosts ends the process when that replica is gone, and where the
host asked for it logs each engine step (engines/step_log.py).
"""

from __future__ import annotations

from engines.cpu_pp_repair import install as install_cpu_pp_repair
from engines.orphan_guard import start_orphan_guard
from engines.step_log import install as install_step_log


def register() -> None:
    install_cpu_pp_repair()
    start_orphan_guard()
    install_step_log()
