"""Each real engine step, logged: what it computed and how long it took.

With ``engine.step_log: FOLDER`` (engines/settings.py), the engine host names a file
for its engine core (``STEP_LOG_ENV``), and our vLLM plugin (engines/vllm_plugin.py)
installs this log in that process: vLLM's scheduler is wrapped so that each step's
shape is read from its output as the latency profiles describe a step
(splitserve/latency/profile.py ``StepShape``: prefill tokens and sequences, the
query-key pairs of the prefill chunks, decode sequences and the context they read),
and the engine core's ``step`` is timed around it. One JSON line a step
(``StepRecord``), and one a request once it finishes (``RequestRecord``: when the engine
core took it in, and when its first and last tokens left a step). It is the rulers'
input (bench/step_ruler.py): a latency model judged on steps it was not fitted on, and
a scheduler replayed from the engine's own arrivals, both free of the HTTP path.

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


class StepRecord(msgspec.Struct, frozen=True, tag="step"):
    """One engine step: its shape (as ``StepShape`` counts it), when it started
    (``time.perf_counter`` of the engine core, seconds) and how long ``step`` took."""

    started: float
    seconds: float
    prefill_tokens: int
    prefill_seqs: int
    attention_pairs: int
    decode_seqs: int
    decode_context_tokens: int


class RequestRecord(msgspec.Struct, frozen=True, tag="request"):
    """One finished request as the engine core saw it (``time.perf_counter``): taken in
    (``add_request``), its first and last tokens out of a step."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    arrived: float
    first_token: float
    last_token: float


LogRecord = StepRecord | RequestRecord


def step_log_path(folder: str, engine: str) -> str:
    return str(Path(folder) / f"{engine.replace('/', '_')}.jsonl")


def read_log(path: Path, offset: int = 0) -> list[LogRecord]:
    """The records of ``path`` from byte ``offset`` (a size it had earlier) on."""
    decoder = msgspec.json.Decoder(LogRecord)
    with path.open("rb") as lines:
        lines.seek(offset)
        return [decoder.decode(line) for line in lines if line.strip()]


def read_steps(path: Path) -> list[StepRecord]:
    return [record for record in read_log(path) if isinstance(record, StepRecord)]


def read_requests(path: Path) -> list[RequestRecord]:
    return [record for record in read_log(path) if isinstance(record, RequestRecord)]


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
    requests = _Requests(sink)
    _wrap_schedule(Scheduler, requests)
    _wrap_step(EngineCore, sink, requests)


class _Requests:
    """Each live request's times, until its last token is written as a RequestRecord."""

    def __init__(self, sink: TextIO) -> None:
        self._sink = sink
        self._encoder = msgspec.json.Encoder()
        self._arrived: dict[str, tuple[float, int]] = {}
        self._first: dict[str, float] = {}
        self._tokens: dict[str, int] = {}

    def arrived(self, request_id: str, prompt_tokens: int) -> None:
        self._arrived[request_id] = (time.perf_counter(), prompt_tokens)

    def outputs(self, outputs: Any, now: float) -> None:
        """A step's outputs (vLLM's EngineCoreOutputs by client), leaving it at ``now``."""
        for by_client in outputs.values():
            for output in by_client.outputs:
                request_id = output.request_id
                if request_id not in self._arrived or not output.new_token_ids:
                    continue
                self._first.setdefault(request_id, now)
                self._tokens[request_id] = self._tokens.get(request_id, 0) + len(
                    output.new_token_ids
                )
                if output.finish_reason is not None:
                    self._finished(request_id, now)

    def _finished(self, request_id: str, now: float) -> None:
        arrived, prompt_tokens = self._arrived.pop(request_id)
        record = RequestRecord(
            request_id,
            prompt_tokens,
            self._tokens.pop(request_id),
            arrived,
            self._first.pop(request_id),
            now,
        )
        self._sink.write(self._encoder.encode(record).decode() + "\n")


def _wrap_schedule(scheduler_class: Any, requests: _Requests) -> None:
    schedule, add_request = scheduler_class.schedule, scheduler_class.add_request

    def logged_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        setattr(self, _SHAPE, _shape(self, output))
        return output

    def logged_add_request(self: Any, request: Any) -> Any:
        requests.arrived(request.request_id, request.num_prompt_tokens)
        return add_request(self, request)

    scheduler_class.schedule = logged_schedule
    scheduler_class.add_request = logged_add_request


def _wrap_step(core_class: Any, sink: TextIO, requests: _Requests) -> None:
    step = core_class.step
    encoder = msgspec.json.Encoder()

    def logged_step(self: Any) -> Any:
        started = time.perf_counter()
        result = step(self)
        ended = time.perf_counter()
        shape = getattr(self.scheduler, _SHAPE, None)
        if shape is not None:
            setattr(self.scheduler, _SHAPE, None)
            record = StepRecord(started, ended - started, *shape)
            sink.write(encoder.encode(record).decode() + "\n")
        requests.outputs(result[0], ended)
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
