"""Where one request runs: which engine of which pool, and for PD where it prefills.

``plan`` decides without side effects, so admission control can refuse a planned request
for free; ``start`` commits the plan: prefix-cache mirrors, choice counts, the stream.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from engines.protocol import GenerateChunk, GenerateRequest
from kv_transfer import KVRouterSide
from router.pd_flow import PrefillDecodeFlow
from router.policies.engine_choice import Choice, EngineChoice, make_engine_choice
from router.policies.prefill_policy import PrefillDecision, PrefillInputs, make_prefill_policy
from router.policies.qos import ENGINE_PRIORITY
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine
from router.pool.prefix_index import PromptBlocks
from router.settings import IngressSettings, Priority
from splitserve.metric_catalogue import PREFILL_HEADER, PREFILL_REPLICA_HEADER, REPLICA_HEADER

# How an auto pool picks the engine that prefills for another (Choice.reason too).
PEER_CHOICE = "soonest_first_token"
# Beside the peers that hold a prompt's prefix: how many of those soonest to start any
# prompt an auto pool weighs for one (router/pool/engine_index.py).
PEERS_WEIGHED = 4


@dataclass(slots=True)
class Plan:
    request: GenerateRequest
    prompt: PromptBlocks
    priority: Priority
    main: Choice  # the engine that generates the answer (mixed or decode)
    prefill: Choice | None  # PD remote prefill only
    decision: PrefillDecision  # as planned: the dispatch's is where the prompt ran
    # Of the engine that computes the prompt: expected prefix-cache hit, tokens left.
    expected_cached_tokens: int
    prefill_tokens: int
    # The same hit by each prefix signal that engine has (engine_state.KV_EVENTS, MIRROR).
    cached_by_signal: dict[str, int] = field(default_factory=dict)

    @property
    def prefill_engine(self) -> PooledEngine:
        return self.prefill.engine if self.prefill else self.main.engine

    def ttft_estimate_s(self) -> float | None:
        engine_priority = ENGINE_PRIORITY[self.priority]
        return self.prefill_engine.state.estimate_ttft_s(self.prefill_tokens, engine_priority)


@dataclass(slots=True)
class Dispatch:
    """A started plan: its stream of deltas, the engines it runs on and where its prompt
    is computed, as it runs: the PD flow replaces ``decision`` where a planned remote
    prefill falls back, always before the first delta (final once it exists)."""

    plan: Plan
    stream: AsyncGenerator[GenerateChunk, None]
    engines: list[PooledEngine]  # whose in-flight counts this request adds to
    prefill_engine: PooledEngine
    expected_cached_tokens: int
    decision: PrefillDecision
    headers: dict[str, str] = field(default_factory=dict)
    disaggregated: bool = False

    def fell_back(self, decision: PrefillDecision) -> None:
        self.decision = decision

    def response_headers(self) -> dict[str, str]:
        """Where the request ran, as it ran: read once its first token exists."""
        headers = dict(self.headers)
        if self.disaggregated:
            headers[PREFILL_HEADER] = f"{self.decision.where}:{self.decision.reason}"
            if self.decision.remote:
                headers[PREFILL_REPLICA_HEADER] = self.prefill_engine.name
        return headers


class Dispatcher:
    def __init__(
        self,
        settings: IngressSettings,
        pool: EnginePool,
        kv: KVRouterSide | None = None,
        transfer_s: Callable[[int], float | None] | None = None,
    ) -> None:
        """``kv``: the KV backend's router side, for PD and auto pools;
        ``transfer_s``: a prompt's expected KV hand-over time, None until measured."""
        # The auto pool: one mixed pool, any engine prefills for any other.
        self._auto_pool = settings.shape == "auto"
        self._disaggregated = kv is not None and not self._auto_pool
        # Read at every request: members may join and leave while the router serves.
        self._pool = pool
        router = settings.router
        roles = ("prefill", "decode") if self._disaggregated else ("mixed",)
        self._choice_names = {role: router.choice_for(role) for role in roles}
        self._choices: dict[str, EngineChoice] = {
            role: make_engine_choice(name, router.choice_settings(name))
            for role, name in self._choice_names.items()
        }
        policy = settings.prefill_policy
        self._prefill_policy = make_prefill_policy(policy.name, policy.settings, settings.qos)
        self._pd = PrefillDecodeFlow(kv) if kv is not None else None
        self._transfer_s = transfer_s or (lambda tokens: None)

    def policy_of(self, choice: Choice, prefill: bool = False) -> str:
        """The engine choice that picked ``choice`` for a plan (``prefill``: the engine
        that computes the prompt remotely)."""
        if self._auto_pool and (prefill or choice.reason == PEER_CHOICE):
            return PEER_CHOICE
        return self._choice_names[choice.engine.role]

    def earliest_ttft_s(self, priority: Priority) -> float | None:
        """The soonest any engine that could compute a prompt of ``priority`` would
        start it: the work queued ahead there, before the prompt's own tokens (a lower
        bound on the estimate of any request of that priority); None if unmeasured.
        Read from the pool's index, not asked of every engine."""
        return self._pool.index.earliest_ttft_s(ENGINE_PRIORITY[priority])

    def queued_requests(self) -> int:
        """Requests router-wide still waiting for their first token."""
        return self._pool.index.queued_requests()

    def plan(self, request: GenerateRequest, priority: Priority) -> Plan:
        prompt = PromptBlocks(request.prompt_token_ids)
        main_role = "decode" if self._disaggregated else "mixed"
        adapter = None if request.lora is None else request.lora.name
        # An unhealthy engine is skipped while another is healthy.
        main = self._choose(main_role, prompt, adapter) or Choice(
            self._pool.of_role(main_role)[0], "unhealthy"
        )
        decision = PrefillDecision("local", "colocated")
        prefill = None
        if self._pd is not None:
            prefill = self._prefill_candidate(main.engine, prompt, priority, adapter)
            if (stays := _stays_on_one_engine(request)) is not None:
                decision, prefill = PrefillDecision("local", stays), None
            elif prefill is None:
                unavailable = "no_peer" if self._auto_pool else "prefill_unavailable"
                decision = PrefillDecision("local", unavailable)
            else:
                decision = self._prefill_policy.decide(
                    self._prefill_inputs(prompt, priority, main.engine, prefill.engine)
                )
                if decision.remote and self._auto_pool and decision.whole_on_peer:
                    # A remote prefill would not pay: the peer computes and generates it all.
                    main, decision = prefill, PrefillDecision("local", decision.whole_on_peer)
                prefill = prefill if decision.remote else None
        computes = (prefill or main).engine.state
        by_signal = computes.cached_tokens_by_signal(prompt)
        cached = by_signal[computes.prefix_signal]
        return Plan(
            request=request,
            prompt=prompt,
            priority=priority,
            main=main,
            prefill=prefill,
            decision=decision,
            expected_cached_tokens=cached,
            prefill_tokens=max(1, len(prompt) - cached),
            cached_by_signal=by_signal,
        )

    def _prefill_candidate(
        self, decode: PooledEngine, prompt: PromptBlocks, priority: Priority, adapter: str | None
    ) -> Choice | None:
        """Who would compute the prompt remotely: the prefill pool's choice, or in an
        auto pool the other healthy engine whose first token would come soonest
        for this priority (the engines schedule by priority: only work of the same or a
        higher priority is ahead of it)."""
        if not self._auto_pool:
            return self._choose("prefill", prompt, adapter)
        engine_priority = ENGINE_PRIORITY[priority]
        hits: dict[PooledEngine, int] = {}
        if adapter is None:
            hits = self._pool.index.cached_tokens("mixed", prompt)
            peers = self._peer_candidates(decode, hits, engine_priority)
        else:
            healthy = self._pool.index.healthy("mixed")
            peers = _holding([r for r in healthy if r is not decode], adapter)
        if not peers:
            return None

        def soonest(engine: PooledEngine) -> tuple[float, int, int]:
            state = engine.state
            cached = hits[engine] if engine in hits else state.cached_tokens(prompt)
            estimate = state.estimate_ttft_s(max(1, len(prompt) - cached), engine_priority)
            return (math.inf if estimate is None else estimate, state.prefill_queue, state.active)

        return Choice(min(peers, key=soonest), PEER_CHOICE)

    def _peer_candidates(
        self, decode: PooledEngine, hits: dict[PooledEngine, int], engine_priority: int
    ) -> list[PooledEngine]:
        """The peers worth weighing for the soonest first token: those that hold the
        prompt's longest cached prefix (``hits``: their hit shortens it), and the few
        that would start any prompt soonest; the index finds both without asking every
        engine. Of peers whose per-token times differ much, one a little later to start
        but quicker to compute may be missed: engines of one pool share a model and a
        device."""
        index = self._pool.index
        soonest = index.soonest(engine_priority, PEERS_WEIGHED, lambda e: e is not decode)
        unmeasured = [] if soonest else [e for e in index.healthy("mixed") if e is not decode]
        held = [engine for engine in hits if engine is not decode]
        return list(dict.fromkeys([*held, *soonest, *unmeasured]))

    def _prefill_inputs(
        self,
        prompt: PromptBlocks,
        priority: Priority,
        decode: PooledEngine,
        prefill: PooledEngine,
    ) -> PrefillInputs:
        engine_priority = ENGINE_PRIORITY[priority]
        local_cached = decode.state.cached_tokens(prompt)
        remote_tokens = max(1, len(prompt) - prefill.state.cached_tokens(prompt))
        local_tokens = max(1, len(prompt) - local_cached)
        return PrefillInputs(
            prompt_len=len(prompt),
            prefix_cached_len=local_cached,
            prefill_queue=prefill.state.prefill_queue,
            decode_active=decode.state.active,
            priority=priority,
            remote_ttft_s=prefill.state.estimate_ttft_s(remote_tokens, engine_priority),
            local_ttft_s=decode.state.estimate_ttft_s(local_tokens, engine_priority),
            prefill_active=prefill.state.active,
            # The decode engine loads what its own cache lacks.
            transfer_s=self._transfer_s(local_tokens),
        )

    def start(self, plan: Plan, on_accepted: Callable[[], None] | None = None) -> Dispatch:
        main = plan.main.engine
        prefill = plan.prefill.engine if plan.prefill is not None else None
        main.state.record_prompt(plan.prompt)
        if prefill is not None:
            # The decode engine caches the blocks it loads, as if it had computed them.
            prefill.state.record_prompt(plan.prompt)
        if self._pd is None:
            stream = main.generate(plan.request, plan.prefill_tokens, on_accepted)
        else:
            # The stream runs once start has returned: ``dispatch`` exists by then.
            stream = self._pd.run(
                plan.request,
                main,
                prefill,
                plan.decision,
                lambda decision: dispatch.fell_back(decision),
                plan.prefill_tokens,
                on_accepted,
            )
        dispatch = Dispatch(
            plan,
            stream,
            [main] if prefill is None else [prefill, main],
            prefill or main,
            plan.expected_cached_tokens,
            plan.decision,
            {REPLICA_HEADER: main.name},
            disaggregated=self._pd is not None,
        )
        return dispatch

    def replan_elsewhere(self, plan: Plan) -> Plan | None:
        """After ``plan``'s engine could not take the request: the same request on
        another healthy engine of its pool, or None (PD falls back on its own)."""
        if self._disaggregated:
            return None
        failed = plan.main.engine
        failed.healthy = False  # until its next successful stats poll
        if not self._pool.index.healthy(failed.role):
            return None
        return self.plan(plan.request, plan.priority)

    def _choose(self, role: str, prompt: PromptBlocks, adapter: str | None) -> Choice | None:
        """A healthy engine of the pool, among those that hold the request's adapter if
        any does; None if none is healthy (the caller decides what then). Every healthy
        engine a candidate: the choice reads the pool's index, if it can."""
        choice = self._choices[role]
        choose_from = getattr(choice, "choose_from", None)
        if adapter is None and choose_from is not None:
            chosen: Choice | None = choose_from(self._pool.index, role, prompt)
            return chosen
        candidates = _holding(self._pool.index.healthy(role), adapter)
        return choice.choose(candidates, prompt) if candidates else None


def _holding(engines: list[PooledEngine], adapter: str | None) -> list[PooledEngine]:
    """The engines that hold ``adapter``, or all of them if none does (each can load it
    from its path, as vLLM does on a request's first use). A remote prefill's two engines
    then both hold it wherever one does: its KV goes only to an engine with its adapter."""
    if adapter is None:
        return engines
    holders = [engine for engine in engines if adapter in engine.adapters]
    return holders or engines


# Why a request's prompt is computed where it is generated, whatever the prefill policy.
PARALLEL_SAMPLING = "parallel_sampling"


def _stays_on_one_engine(request: GenerateRequest) -> str | None:
    """``n`` > 1: the engine samples every completion's first token from one prompt
    computation (its prefix cache shares the blocks); prefilled remotely, only one first token would
    come from the prefill engine and each completion would load the KV again."""
    if (getattr(request.sampling_params, "n", 1) or 1) > 1:
        return PARALLEL_SAMPLING
    return None
