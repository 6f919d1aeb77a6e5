"""A simulated decode engine's intake of handed-over KV.

A link's bandwidth is shared: where several prompts' KV head for one decode engine at
once, their bytes cross its link one after another (vLLM's connectors, ours included,
load a request's KV in order), so a burst of hand-overs queues. The fixed latency of
each (the messages that announce and claim it) overlaps with the others' bytes.
"""

from __future__ import annotations

from splitserve.latency.profile import LatencyProfile


class HandoverLink:
    """When each hand-over's KV has arrived at one decode engine; keeps no clock (the
    caller's, in real or virtual seconds)."""

    def __init__(self, profile: LatencyProfile, time_scale: float = 1.0) -> None:
        self._profile = profile
        self._time_scale = time_scale
        self._free_at = float("-inf")

    def arrival(self, start: float, tokens: int) -> float:
        """The end of a hand-over of ``tokens`` of KV that is ready to move at ``start``,
        behind every hand-over already on the link."""
        moving_s = self._profile.handover_bytes_seconds(tokens) * self._time_scale
        self._free_at = max(start, self._free_at) + moving_s
        return self._free_at + self._profile.handover_latency_s * self._time_scale
