"""Where one request runs: which replica of which pool, and for PD where it prefills.

``plan`` decides without side effects, so admission control can refuse a planned request
for free; ``start`` commits the plan: prefix-cache mirrors, choice counts, the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engines.protocol import GenerateChunk, GenerateRequest
from kv_transfer import KVRouterSide
from router.engine_client import EngineClient
from router.engine_pool import EnginePool
from router.pd import PrefillDecodeFlow, PrefillOutcome
from router.prefix_index import PromptBlocks
from router.qos import ENGINE_PRIORITY
from router.replica_choice import Choice, ReplicaChoice, make_replica_choice
from router.settings import IngressSettings, Priority
from router.split_policy import SplitDecision, SplitInputs, make_split_policy

REPLICA_HEADER = "x-splitserve-replica"
PREFILL_REPLICA_HEADER = "x-splitserve-prefill-replica"
PREFILL_HEADER = "x-splitserve-prefill"


@dataclass(slots=True)
class Plan:
    request: GenerateRequest
    prompt: PromptBlocks
    priority: Priority
    main: Choice  # the replica that generates the answer (mixed or decode)
    prefill: Choice | None  # PD remote prefill only
    decision: SplitDecision
    # Of the replica that computes the prompt: expected prefix-cache hit, tokens left.
    expected_cached_tokens: int
    prefill_tokens: int

    @property
    def prefill_replica(self) -> EngineClient:
        return self.prefill.replica if self.prefill else self.main.replica

    def ttft_estimate_s(self) -> float | None:
        engine_priority = ENGINE_PRIORITY[self.priority]
        return self.prefill_replica.state.estimate_ttft_s(self.prefill_tokens, engine_priority)


@dataclass(slots=True)
class Dispatch:
    plan: Plan
    stream: AsyncIterator[GenerateChunk]
    replicas: list[EngineClient]  # whose in-flight counts this request adds to
    outcome: PrefillOutcome
    prefill_replica: EngineClient
    expected_cached_tokens: int
    headers: dict[str, str] = field(default_factory=dict)
    released: bool = False  # its stream closed and its counts undone (router/ingress.py)
    disaggregated: bool = False

    def response_headers(self) -> dict[str, str]:
        """Where the request ran, as it ran: read once its first token exists, since a
        remote prefill that fails falls back to the decode replica."""
        headers = dict(self.headers)
        if self.disaggregated:
            headers[PREFILL_HEADER] = f"{self.outcome.where}:{self.outcome.reason}"
            if self.outcome.where == "remote":
                headers[PREFILL_REPLICA_HEADER] = self.prefill_replica.name
        return headers


class Dispatcher:
    def __init__(
        self,
        settings: IngressSettings,
        pool: EnginePool,
        kv: KVRouterSide | None = None,
    ) -> None:
        self._disaggregated = kv is not None
        # Read at every request: members may join and leave while the router serves.
        self._pool = pool
        router = settings.router
        roles = ("prefill", "decode") if self._disaggregated else ("mixed",)
        self._choice_names = {role: router.choice_for(role) for role in roles}
        self._choices: dict[str, ReplicaChoice] = {
            role: make_replica_choice(name, router.choice_settings(name))
            for role, name in self._choice_names.items()
        }
        split = settings.split_policy
        self._split_policy = make_split_policy(split.mode, split.settings, settings.qos)
        self._pd = PrefillDecodeFlow(kv) if kv is not None else None

    def policy_of(self, role: str) -> str:
        return self._choice_names[role]

    def earliest_ttft_s(self, priority: Priority) -> float | None:
        """The soonest any replica that could compute a prompt of ``priority`` would
        start it: the work queued ahead there, before the prompt's own tokens (a lower
        bound on the estimate of any request of that priority); None if unmeasured."""
        engine_priority = ENGINE_PRIORITY[priority]
        estimates = [
            replica.state.estimate_ttft_s(0, engine_priority)
            for replica in self._pool
            if replica.healthy
        ]
        known = [estimate for estimate in estimates if estimate is not None]
        return min(known) if known and len(known) == len(estimates) else None

    def queued_requests(self) -> int:
        """Requests router-wide still waiting for their first token."""
        return sum(c.state.queued_prefills for c in self._pool)

    def plan(self, request: GenerateRequest, priority: Priority) -> Plan:
        prompt = PromptBlocks(request.prompt_token_ids)
        main_role = "decode" if self._disaggregated else "mixed"
        # An unhealthy replica is skipped while another is healthy.
        main = self._choose(main_role, prompt) or Choice(
            self._pool.of_role(main_role)[0], "unhealthy"
        )
        local_cached = main.replica.state.cached_tokens(prompt)
        decision = SplitDecision("local", "colocated")
        prefill = None
        if self._disaggregated:
            prefill = self._choose("prefill", prompt)
            if prefill is None:
                decision = SplitDecision("local", "prefill_unavailable")
            else:
                engine_priority = ENGINE_PRIORITY[priority]
                remote_tokens = max(1, len(prompt) - prefill.replica.state.cached_tokens(prompt))
                local_tokens = max(1, len(prompt) - local_cached)
                decision = self._split_policy.decide(
                    SplitInputs(
                        prompt_len=len(prompt),
                        prefix_cached_len=local_cached,
                        prefill_queue=prefill.replica.state.prefill_queue,
                        decode_active=main.replica.state.active,
                        priority=priority,
                        remote_ttft_s=prefill.replica.state.estimate_ttft_s(
                            remote_tokens, engine_priority
                        ),
                        local_ttft_s=main.replica.state.estimate_ttft_s(
                            local_tokens, engine_priority
                        ),
                    )
                )
                prefill = prefill if decision.remote else None
        cached = prefill.replica.state.cached_tokens(prompt) if prefill else local_cached
        return Plan(
            request=request,
            prompt=prompt,
            priority=priority,
            main=main,
            prefill=prefill,
            decision=decision,
            expected_cached_tokens=cached,
            prefill_tokens=max(1, len(prompt) - cached),
        )

    def start(self, plan: Plan, on_accepted: Callable[[], None] | None = None) -> Dispatch:
        main = plan.main.replica
        headers = {REPLICA_HEADER: main.name}
        main.state.record_prompt(plan.prompt)
        outcome = PrefillOutcome(plan.decision.where, plan.decision.reason)
        if plan.prefill is None:
            if self._pd is not None:
                stream = self._pd.run(
                    plan.request, main, None, outcome, plan.prefill_tokens, on_accepted
                )
            else:
                stream = main.generate(plan.request, plan.prefill_tokens, on_accepted)
            return Dispatch(
                plan,
                stream,
                [main],
                outcome,
                main,
                plan.expected_cached_tokens,
                headers,
                disaggregated=self._pd is not None,
            )
        prefill = plan.prefill.replica
        assert self._pd is not None  # a remote prefill is planned for PD only
        # The decode replica caches the blocks it loads, as if it had computed them.
        prefill.state.record_prompt(plan.prompt)
        stream = self._pd.run(
            plan.request, main, prefill, outcome, plan.prefill_tokens, on_accepted
        )
        return Dispatch(
            plan,
            stream,
            [prefill, main],
            outcome,
            prefill,
            plan.expected_cached_tokens,
            headers,
            disaggregated=True,
        )

    def replan_elsewhere(self, plan: Plan) -> Plan | None:
        """After ``plan``'s replica could not take the request: the same request on
        another healthy replica of its pool, or None (PD falls back on its own)."""
        if self._pd is not None:
            return None
        failed = plan.main.replica
        failed.healthy = False  # until its next successful stats poll
        if not any(r.healthy for r in self._pool.of_role(failed.role)):
            return None
        return self.plan(plan.request, plan.priority)

    def _choose(self, role: str, prompt: PromptBlocks) -> Choice | None:
        """A healthy replica of the pool; None if none is (the caller decides what then)."""
        healthy = [replica for replica in self._pool.of_role(role) if replica.healthy]
        return self._choices[role].choose(healthy, prompt) if healthy else None
