"""Each real engine step, logged: what it computed and how long it took.

With ``engine.step_log: FOLDER`` (engines/settings.py), the engine host names a file
for its engine core (``STEP_LOG_ENV``), and our vLLM plugin (engines/vllm_plugin.py)
installs this log in that process: vLLM's scheduler is wrapped so that each step's
shape is read from its output as the latency profiles describe a step
(splitserve/latency/profile.py ``StepShape``: prefill tokens and sequences, the
query-key pairs of the prefill chunks, decode sequences and the context they read),
and the engine core's ``step`` is timed around it. One JSON line a step:
``StepRecord``. It is the step-level ruler's input (bench/step_ruler.py): a latency
model is judged on steps it was not fitted on, free of the HTTP path and the box's
noise between requests.

The shape is read after ``schedule`` returns, when vLLM has already advanced each
scheduled request's computed tokens by its chunk: what it had computed before the step
is that less the chunk.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

import msgspec

logger = logging.getLogger("splitserve.engines")
# The file an engine core appends its steps to, set by the engine host for its processes.
STEP_LOG_ENV = "SPLITSERVE_STEP_LOG"
_SHAPE = "_splitserve_step_shape"


class StepRecord(msgspec.Struct, frozen=True):
    """One engine step: its shape (as ``StepShape`` counts it), when it started
    (``time.perf_counter`` of the engine core, seconds) and how long ``step`` took."""

    started: float
    seconds: float
    prefill_tokens: int
    prefill_seqs: int
    attention_pairs: int
    decode_seqs: int
    decode_context_tokens: int


def step_log_path(folder: str, engine: str) -> str:
    return str(Path(folder) / f"{engine.replace('/', '_')}.jsonl")


def read_steps(path: Path) -> list[StepRecord]:
    decoder = msgspec.json.Decoder(StepRecord)
    with path.open("rb") as lines:
        return [decoder.decode(line) for line in lines if line.strip()]


def install() -> None:
    """Log this process's engine steps, if its host asked for it (``STEP_LOG_ENV``)."""
    path = os.environ.get(STEP_LOG_ENV)
    if not path:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore.step, "_splitserve_logged", False):
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    sink = out.open("a", buffering=1)  # a line at a time: a killed engine loses none
    _wrap_schedule(Scheduler)
    _wrap_step(EngineCore, sink)


def _wrap_schedule(scheduler_class: Any) -> None:
    schedule = scheduler_class.schedule

    def logged_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        setattr(self, _SHAPE, _shape(self, output))
        return output

    scheduler_class.schedule = logged_schedule


def _wrap_step(core_class: Any, sink: TextIO) -> None:
    step = core_class.step
    encoder = msgspec.json.Encoder()

    def logged_step(self: Any) -> Any:
        started = time.perf_counter()
        result = step(self)
        shape = getattr(self.scheduler, _SHAPE, None)
        if shape is not None:
            setattr(self.scheduler, _SHAPE, None)
            record = StepRecord(started, time.perf_counter() - started, *shape)
            sink.write(encoder.encode(record).decode() + "\n")
        return result

    logged_step._splitserve_logged = True  # type: ignore[attr-defined]
    core_class.step = logged_step


def _shape(scheduler: Any, output: Any) -> tuple[int, int, int, int, int] | None:
    """(prefill tokens, prefill seqs, attention pairs, decode seqs, decode context) of
    ``output``; None for a step that computes nothing."""
    prefill_tokens = prefill_seqs = pairs = decode_seqs = context = 0
    for request_id, tokens in output.num_scheduled_tokens.items():
        request = scheduler.requests.get(request_id)
        if request is None or tokens <= 0:
            continue
        before = request.num_computed_tokens - tokens
        if before < request.num_prompt_tokens:
            prefill_seqs += 1
            prefill_tokens += tokens
            pairs += tokens * before + tokens * (tokens + 1) // 2
        else:
            decode_seqs += 1
            context += before + 1
    if not prefill_tokens and not decode_seqs:
        return None
    return prefill_tokens, prefill_seqs, pairs, decode_seqs, context
