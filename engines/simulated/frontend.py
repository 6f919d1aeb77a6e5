"""vLLM's front end as a simulated engine keeps it: the input processing of each request
(parsing, tokenization, the engine client's bookkeeping: the profile's
``request_overhead_s``) on one thread, one request after another.

What it has taken in reaches the scheduler once it has nothing left to take in: its
event loop runs every request handler that is ready before the engine client's sends.
Public runs show it: ten prompts sent at once to vLLM 0.6.0 all got their first token
within 0.5 ms of each other (one prefill step for all ten), 62 ms after they were sent
on an H100 and 139 ms on an A100; the prefill of their 1,369 tokens takes about 33 and
108 ms there, which leaves about 3 ms of input processing a request, the same on both
machines; and at 320 prompts even the first one answered waited a second, about 320
times that (LambdaLabsML/vllm-benchmark's result files, splitserve/latency/public_runs).

It keeps no clock: ``take`` says when the thread is next free, and the driver calls
``release`` then (offline, at that virtual time; in real time, by a timer).
"""

from __future__ import annotations

import math

from engines.simulated.scheduler import SimRequest


class FrontEnd:
    def __init__(self, intake_s: float) -> None:
        self.intake_s = intake_s
        self._busy_until = -math.inf
        self._taken: dict[str, SimRequest] = {}

    def take(self, request: SimRequest, now: float) -> float:
        """``request`` arrives at ``now``: when the front end will have taken it (and
        what came before it) in; call ``release`` then."""
        self._busy_until = max(now, self._busy_until) + self.intake_s
        self._taken[request.request_id] = request
        return self._busy_until

    def release(self, at: float) -> list[SimRequest]:
        """What reaches the scheduler at ``at``: everything taken in, once nothing more
        was taken since (a later ``take`` moved the time on; its ``release`` will)."""
        if at < self._busy_until or not self._taken:
            return []
        released = list(self._taken.values())
        self._taken.clear()
        return released

    def kv_arrived(self, request_id: str) -> bool:
        """A hand-over's KV arrived for a request perhaps still being taken in (a burst
        is released together, after the first ones' KV may have crossed): whether it
        was held here, now marked so that the scheduler starts loading it on release."""
        request = self._taken.get(request_id)
        if request is not None:
            request.kv_ready = True
        return request is not None

    def drop(self, request_id: str) -> bool:
        """Forget a request still being taken in (aborted); whether it was."""
        return self._taken.pop(request_id, None) is not None
