"""What the router knows about one engine when it routes.

Two sources, combined: the router's own counts (exact and instant, but blind to other
router processes) and the engine's last report (every ``stats_interval_s``, covering all
routers, but stale by up to that interval plus a transport round trip). Load figures
take the larger of the two. Beside them: the engine's prefix cache as its KV events
describe it (or the router's mirror of what it sent, where events are off), and the
per-token prefill and decode times behind the TTFT estimates admission and the prefill
policies read.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from engines.protocol import CacheUpdate, EngineStats
from router.pool.prefix_index import BlockIndex, PrefixHolders, PrefixIndex, PromptBlocks

# The prefix-cache signals, as metrics label them: the engine's KV events, the mirror.
KV_EVENTS, MIRROR = "kv_events", "mirror"


class MovingAverage:
    """Exponentially weighted; None until the first sample. ``on_change``: called after
    each sample (the engine index refiles its engine)."""

    def __init__(self, weight: float, on_change: Callable[[], None] | None = None) -> None:
        self._weight = weight
        self._on_change = on_change
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.add_all((sample,))

    def add_all(self, samples: Iterable[float]) -> None:
        """Each sample in turn, as ``add`` would, with one ``on_change`` after them all."""
        value, weight = self.value, self._weight
        for sample in samples:
            value = sample if value is None else value + weight * (sample - value)
        self.value = value
        if self._on_change is not None:
            self._on_change()


@dataclass(slots=True)
class PrefillTicket:
    """One prefill the router has queued on a engine, until its first token."""

    tokens: int
    tokens_ahead: int
    submitted_at: float
    priority: int = 0
    inside: bool = False  # let into the engine (past the router's prefill gate)
    closed: bool = False


@dataclass(slots=True)
class StreamTiming:
    """What one request's stream on an engine tells the engine's state: its first token
    closes the prefill ticket (a sample of the per-token prefill time), and each later
    chunk samples the decode step, per token (a multi-step group's tokens come in one
    chunk). The router's stream (``PooledEngine.generate``) and the offline simulation
    (deployments/simulate.py) time requests through this one class."""

    state: EngineState
    ticket: PrefillTicket
    last_token_at: float | None = None

    def tokens(self, now: float, count: int, finished: bool) -> None:
        """``count`` tokens arrived at ``now`` in one chunk; ``finished``: the last."""
        if self.last_token_at is None:
            # A non-streamed answer arrives whole at the end: not a first-token time.
            timed = count == 1 or not finished
            self.state.finish_prefill(self.ticket, now, first_token=timed)
        else:
            self.state.step_s.add((now - self.last_token_at) / count)
        self.last_token_at = now

    def run_tokens(self, times: Sequence[float], finished: bool) -> None:
        """A run of steps' tokens, one per time (equal times: one step's or multi-step
        group's chunk), read as ``tokens`` would read their chunks one by one; the last
        finishes the stream where ``finished``. (The offline simulation delivers a
        request's tokens a run at a time.)"""
        if self.last_token_at is None:
            first = times[0]
            count = 1
            while count < len(times) and times[count] == first:
                count += 1
            self.tokens(first, count, finished and count == len(times))
            times = times[count:]
        if not times:
            return
        last = self.last_token_at
        assert last is not None
        if len(set(times)) == len(times):  # a step a token: the common case, in one pass
            gaps = [at - before for before, at in zip((last, *times), times, strict=False)]
        else:
            gaps = []
            count = 0
            for index, at in enumerate(times):
                count += 1
                if index + 1 < len(times) and times[index + 1] == at:
                    continue
                gaps.append((at - last) / count)
                last, count = at, 0
        self.last_token_at = times[-1]
        self.state.step_s.add_all(gaps)

    def closed(self, now: float) -> None:
        """The stream ended, with or without a first token."""
        self.state.finish_prefill(self.ticket, now, first_token=False)


@dataclass
class EngineState:
    ema_weight: float = 0.2
    min_prefill_tokens_per_sample: int = 64
    # How long a sent prompt's blocks count as cached before the engine's events say so.
    kv_events_pending_s: float = 0.0
    # Requests on the engine from this router: a request's life (router/lifecycle.py)
    # counts itself in at its start and out at its release.
    _in_flight: int = 0
    queued_prefills: int = 0
    queued_prefill_tokens: int = 0
    # Of those: inside the engine already (any priority: it runs them whatever comes),
    # and still waiting at the router's prefill gate, by vLLM priority (lower first): a
    # new request waits behind what is inside and what waits with its own or a better
    # priority, as the gate and the engine order them.
    inside_tokens: int = 0
    waiting_tokens_by_priority: dict[int, int] = field(default_factory=dict)
    engine: EngineStats | None = None
    prefix: PrefixIndex | None = None
    # From the engine's KV events, once it sends any (then the signal routing uses).
    blocks: BlockIndex | None = None
    # Seconds of time-to-first-token per prefill token queued ahead or in the prompt.
    prefill_s_per_token: MovingAverage = field(init=False)
    # Seconds between tokens: the decode step a new prompt is batched into.
    step_s: MovingAverage = field(init=False)
    # Called after every change that a decision reads (the pool's EngineIndex refiles
    # the engine): load, queue, estimates, health.
    on_change: Callable[[], None] | None = field(default=None, repr=False)
    # The pool's inverse prefix index and this engine's name in it, which its KV events
    # keep (router/pool/engine_index.py).
    holders: PrefixHolders | None = field(default=None, repr=False)
    owner: Hashable = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.prefill_s_per_token = MovingAverage(self.ema_weight, self.changed)
        self.step_s = MovingAverage(self.ema_weight, self.changed)

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        self._in_flight = value
        self.changed()

    # ---- load -----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Requests on the engine: the router's own, or the engine's count if larger."""
        engine = self.engine
        reported = engine.num_running + engine.num_waiting if engine else 0
        return max(self.in_flight, reported)

    @property
    def prefill_queue(self) -> int:
        """Prefills queued or running on the engine."""
        engine = self.engine
        reported = engine.num_waiting if engine else 0
        if engine is not None and engine.role == "prefill":
            reported += engine.num_running  # a prefill engine runs nothing but prefills
        return max(self.queued_prefills, reported)

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage if self.engine else 0.0

    def update_engine(self, stats: EngineStats) -> None:
        self.engine = stats
        self.changed()
        if stats.block_size and stats.kv_capacity_blocks:
            prefix = self.prefix
            if prefix is None or (prefix.block_size, prefix.capacity_blocks) != (
                stats.block_size,
                stats.kv_capacity_blocks,
            ):
                self.prefix = PrefixIndex(stats.block_size, stats.kv_capacity_blocks)

    # ---- prefix cache ---------------------------------------------------------------------

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        """Leading prompt tokens the engine holds: by its KV events where it sends them,
        else by the mirror of what the router sent it."""
        if self.block_size and self.blocks is not None:
            return self.blocks.cached_tokens(prompt, self.block_size)
        return self.prefix.cached_tokens(prompt) if self.prefix else 0

    @property
    def prefix_signal(self) -> str:
        return KV_EVENTS if self.block_size and self.blocks is not None else MIRROR

    def cached_tokens_by_signal(self, prompt: PromptBlocks) -> dict[str, int]:
        """Each available signal's count, for routing and for checking them against vLLM."""
        counts = {MIRROR: self.prefix.cached_tokens(prompt) if self.prefix else 0}
        if self.block_size and self.blocks is not None:
            counts[KV_EVENTS] = self.blocks.cached_tokens(prompt, self.block_size)
        return counts

    @property
    def block_size(self) -> int:
        """The engine's KV block in tokens, as its stats report it (0 until they do)."""
        return self.engine.block_size if self.engine is not None else 0

    def record_prompt(self, prompt: PromptBlocks) -> None:
        if self.prefix is not None:
            self.prefix.record(prompt)
        if self.blocks is not None and self.block_size:
            self.blocks.expect(prompt, self.block_size)

    def keep_holders(self, holders: PrefixHolders) -> None:
        """From now on, tell the pool's ``holders`` of every block this engine holds or
        is expected to, starting with those it holds already."""
        self.holders = holders
        if self.blocks is not None:
            self.blocks.keep_holders(holders, self.owner)

    def apply_cache_update(self, update: CacheUpdate) -> None:
        if self.blocks is None:
            self.blocks = BlockIndex(self.kv_events_pending_s, self.holders, self.owner)
            self.changed()  # its prefix signal is the engine's events now
        self.blocks.apply(update)

    def forget_blocks(self) -> None:
        """The engine's cache may be gone (its delta stream broke): its next stream
        starts with a snapshot, and until then its prefix signal is the mirror."""
        if self.blocks is not None:
            self.blocks.forget()
            self.blocks = None
            self.changed()

    # ---- time to first token --------------------------------------------------------------

    def tokens_ahead(self, priority: int) -> int:
        """Queued prefill tokens that go before a new request of ``priority``."""
        waiting = self.waiting_tokens_by_priority
        return self.inside_tokens + sum(t for p, t in waiting.items() if p <= priority)

    def estimate_ttft_s(self, prefill_tokens: int, priority: int = 0) -> float | None:
        """Queued prefill work ahead of this priority plus this prompt's, at the measured
        per-token time, plus one decode step; None until the engine has been measured
        (the router measures it before admitting anything: router/pool/calibration.py)."""
        per_token = self.prefill_s_per_token.value
        if per_token is None:
            return None
        step = self.step_s.value or 0.0
        return (self.tokens_ahead(priority) + prefill_tokens) * per_token + step

    def open_stream(self, prefill_tokens: int, now: float, priority: int = 0) -> StreamTiming:
        """A request's stream starts here, its prompt's ``prefill_tokens`` queued."""
        return StreamTiming(self, self.enqueue_prefill(prefill_tokens, now, priority))

    def enqueue_prefill(self, tokens: int, now: float, priority: int = 0) -> PrefillTicket:
        """A request that must compute ``tokens`` prompt tokens here before its first token;
        one whose KV was transferred computes none and does not queue."""
        ahead = self.tokens_ahead(priority)
        ticket = PrefillTicket(tokens, ahead, now, priority, closed=tokens == 0)
        if tokens:
            self.queued_prefills += 1
            self.queued_prefill_tokens += tokens
            waiting = self.waiting_tokens_by_priority
            waiting[priority] = waiting.get(priority, 0) + tokens
            self.changed()
        return ticket

    def enter_engine(self, ticket: PrefillTicket) -> None:
        """The router let the prefill into the engine: no later arrival overtakes it."""
        if ticket.closed or ticket.inside:
            return
        ticket.inside = True
        self.waiting_tokens_by_priority[ticket.priority] -= ticket.tokens
        self.inside_tokens += ticket.tokens
        self.changed()

    def finish_prefill(self, ticket: PrefillTicket, now: float, first_token: bool) -> None:
        """The first token arrived (a time sample) or the request ended without one."""
        if ticket.closed:
            return
        ticket.closed = True
        self.queued_prefills -= 1
        self.queued_prefill_tokens -= ticket.tokens
        if ticket.inside:
            self.inside_tokens -= ticket.tokens
        else:
            self.waiting_tokens_by_priority[ticket.priority] -= ticket.tokens
        work = ticket.tokens_ahead + ticket.tokens
        if first_token and work >= self.min_prefill_tokens_per_sample:
            self.prefill_s_per_token.add((now - ticket.submitted_at) / work)
        else:
            self.changed()
