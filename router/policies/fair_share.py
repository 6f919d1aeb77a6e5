"""Fair shares between API keys: within a priority, keys are served in weighted turns.

A flow is one API key's requests (every request without a key is one flow). Within a
priority, each request is given a turn: its finish tag, that is its start (the later
of the priority's virtual time and its flow's last finish tag) plus 1 / the flow's
weight. The engines (vLLM's priority scheduling, the simulated scheduler) and the
router's prefill gate order a priority's waiting requests by turn, then by arrival
(``GenerateRequest.scheduling_priority``), so a flow with weight 3 is started three
times for each start of a flow with weight 1 while both have requests waiting, a flow
that was idle starts next rather than behind another's backlog, and a flow alone takes
every start. The virtual time is the earliest start among the priority's waiting
requests (start-time fair queueing's: the start of the one in line), and where none
waits the latest start served. Not the latest served: a model's engines each start
their own queue, and one engine that reaches a flow's later turns first would move
every other flow's new turns behind the rest of that flow's queue.

Admission weighs the same shares (router/policies/qos.py): where a priority's queue cap
or TTFT limit would refuse a request, a flow with fewer requests waiting than its
weighted share of that priority's waiting keeps its place and is admitted; a flow at or
over its share is refused first. A flow's share is its weight over the weights of the
flows with requests waiting at that priority, itself included.

Turns cost a request one unit, whatever its length: the issue's weighted round-robin of
requests, and what a key's weight promises (its share of starts).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from router.settings import PRIORITIES, Priority

# The finish tag in 1/TURN_SCALE units of one request, so that weights up to a thousand
# keep their order in an integer.
TURN_SCALE = 1 << 10


@dataclass(frozen=True, slots=True)
class Flow:
    """The requests fair shares are kept between: one API key's (by its configured
    name, never the key), or all requests without a key."""

    name: str
    weight: float = 1.0


@dataclass(slots=True)
class _Priority:
    """One priority's flows: requests waiting for their first token, their starts,
    each flow's last finish tag."""

    waiting: dict[str, int] = field(default_factory=dict)
    waiting_weight: float = 0.0  # the weights of flows with requests waiting
    total: int = 0
    finish: dict[str, float] = field(default_factory=dict)
    # The waiting requests' starts, least first; those no longer waiting are dropped
    # when they reach the top.
    starts: list[tuple[float, int]] = field(default_factory=list)
    gone: set[int] = field(default_factory=set)
    latest_started: float = 0.0

    def virtual(self) -> float:
        starts = self.starts
        while starts and starts[0][1] in self.gone:
            self.gone.discard(heapq.heappop(starts)[1])
        return starts[0][0] if starts else self.latest_started


@dataclass(frozen=True, slots=True)
class Standing:
    """A flow's place at one priority when a request of it arrives: its requests
    waiting, its share (0 to 1], and the priority's requests waiting."""

    waiting: int
    share: float
    priority_waiting: int

    def under_share(self, cap: int | None = None) -> bool:
        """Fewer waiting than its share of the priority's waiting (and, with ``cap``,
        of that cap): the flow keeps its place where the priority is full."""
        of = self.priority_waiting if cap is None else min(self.priority_waiting, cap)
        return self.waiting < self.share * of


class Turn:
    """One request's turn: counted as waiting from ``FairShares.join`` until its first
    token (``started``) or its end (``release``)."""

    __slots__ = ("_flow", "_id", "_shares", "_start", "number")

    def __init__(
        self, shares: _Priority | None, flow: Flow, start: float, finish: float, id_: int
    ) -> None:
        self._shares = shares
        self._flow = flow
        self._start = start
        self._id = id_
        self.number = int(finish * TURN_SCALE)

    def started(self) -> None:
        if self._shares is not None:
            self._shares.latest_started = max(self._shares.latest_started, self._start)
        self.release()

    def release(self) -> None:
        shares, self._shares = self._shares, None
        if shares is None:
            return
        shares.gone.add(self._id)
        name = self._flow.name
        shares.waiting[name] -= 1
        shares.total -= 1
        if not shares.waiting[name]:
            del shares.waiting[name]
            shares.waiting_weight -= self._flow.weight


class FairShares:
    """One served model's flows, per priority (see the module's docstring)."""

    def __init__(self) -> None:
        self._priorities = {priority: _Priority() for priority in PRIORITIES}
        self._ids = itertools.count()

    def standing(self, flow: Flow, priority: Priority) -> Standing:
        shares = self._priorities[priority]
        waiting = shares.waiting.get(flow.name, 0)
        others = shares.waiting_weight - (flow.weight if waiting else 0.0)
        return Standing(waiting, flow.weight / (others + flow.weight), shares.total)

    def join(self, flow: Flow, priority: Priority) -> Turn:
        """An admitted request's turn, counted as waiting until it starts or ends."""
        shares = self._priorities[priority]
        start = max(shares.virtual(), shares.finish.get(flow.name, 0.0))
        finish = shares.finish[flow.name] = start + 1.0 / flow.weight
        waiting = shares.waiting.get(flow.name, 0)
        if not waiting:
            shares.waiting_weight += flow.weight
        shares.waiting[flow.name] = waiting + 1
        shares.total += 1
        id_ = next(self._ids)
        heapq.heappush(shares.starts, (start, id_))
        return Turn(shares, flow, start, finish, id_)

    def waiting(self, flow: Flow, priority: Priority) -> int:
        return self._priorities[priority].waiting.get(flow.name, 0)
