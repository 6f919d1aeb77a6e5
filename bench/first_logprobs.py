"""What an eager CPU engine's first logprobs request costs, with and without torch.compile
(benchmark, not a test).

vLLM compiles a few helpers with inductor whatever ``enforce_eager`` says; the logprob
ranks' (``vllm/v1/sample/ops/logprobs.py``) compiles on the first request that asks
for logprobs, and on a CPU inductor runs g++ for it. Each round starts one engine of
the embedded model in a fresh process (``vllm.LLM``, as our engines are configured on
CPUs: eager, float32) with an empty inductor cache, times the start and one 4-token
request with logprobs, and reads the CPU time of the process and its children.
``TORCHDYNAMO_DISABLE=1`` is what our CPU engines run with (deployments/app.py
``NO_COMPILE_ENV``). Rounds alternate the two settings.

    python bench/first_logprobs.py [--rounds 2] [--out results/first_logprobs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import repo_first  # noqa: F401  (before deployments: see bench/repo_first.py)
from rich.console import Console
from rich.table import Table

from deployments.app import NO_COMPILE_ENV
from engines.tiny_model import embedded_model_path

console = Console()
SETTINGS = {"torch.compile (vLLM's default)": {}, "TORCHDYNAMO_DISABLE=1 (ours)": NO_COMPILE_ENV}
ENGINE = """
import json, sys, time
from vllm import LLM, SamplingParams
def main() -> None:
    started = time.monotonic()
    llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=2048,
              num_gpu_blocks_override=512)
    ready = time.monotonic()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, logprobs=2))
    done = time.monotonic()
    print("RESULT " + json.dumps({"start_s": ready - started, "first_logprobs_s": done - ready}))
if __name__ == "__main__":
    main()
"""


def one_round(model: str, env: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = subprocess.run(
            [sys.executable, "-c", ENGINE, model],
            env={
                **os.environ,
                **env,
                "TORCHINDUCTOR_CACHE_DIR": cache,
                "VLLM_CPU_KVCACHE_SPACE": "1",
            },
            capture_output=True,
            text=True,
            timeout=600,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the engine failed:\n{result.stderr[-3000:]}")
    figures: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {**figures, "cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results/first_logprobs"))
    args = parser.parse_args()
    model = str(embedded_model_path())
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            runs[name].append(one_round(model, env))
    table = Table(title=f"an eager CPU engine's first logprobs request, medians of {args.rounds}")
    for column in ("setting", "start s", "first logprobs request s", "CPU s (all processes)"):
        table.add_column(column)
    for name, rounds in runs.items():
        medians = [
            statistics.median(r[key] for r in rounds)
            for key in ("start_s", "first_logprobs_s", "cpu_s")
        ]
        table.add_row(name, *(f"{value:.2f}" for value in medians))
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_logprobs.json").write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
