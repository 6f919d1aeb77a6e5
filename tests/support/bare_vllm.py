"""Bare `vllm serve` on the embedded model, with the flags the shipped YAMLs give it:
the oracle the router's answers are compared with."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deployments.launcher import RAY_WORKER_NICENESS
from engines.socket_folders import VLLM_IPC_ENV
from engines.tiny_model import EMBEDDED_MODEL_NAME, embedded_model_path
from splitserve.processes import ChildSettings, http_ok, running_process
from tests.support.local_ports import free_port

# As the shipped YAMLs run the embedded model (float32, eager on CPUs, hermes tool calls).
FLAGS = (
    "--dtype", "float32", "--enforce-eager",
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
)  # fmt: skip


@contextmanager
def bare_vllm(
    folder: Path,
    model_path: Path | None = None,
    served_name: str = EMBEDDED_MODEL_NAME,
    extra_flags: tuple[str, ...] = (),
) -> Iterator[str]:
    """The server's base URL while it runs; its log and IPC sockets under ``folder``.
    ``model_path``: another model than the embedded one; ``extra_flags``: more of
    `vllm serve`'s flags (e.g. --enable-lora --lora-modules)."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path or embedded_model_path()), "--served-model-name", served_name,
        "--port", str(port), *FLAGS, *extra_flags,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    env[VLLM_IPC_ENV] = str(folder)  # its IPC sockets stay out of /tmp itself
    with running_process(
        command,
        folder / "server.log",
        lambda: http_ok(f"{url}/health"),
        what="bare vLLM server",
        ready_timeout_s=300,
        stop_timeout_s=60,
        env=env,
        child=ChildSettings(niceness=RAY_WORKER_NICENESS),
    ):
        yield url
