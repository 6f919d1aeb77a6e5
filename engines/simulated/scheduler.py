"""vLLM's scheduler, without the model: which requests' tokens each engine step runs.

Kept to what decides time: continuous batching under a token budget
(``max_num_batched_tokens``) and ``max_num_seqs``; chunked prefill (running requests
first, then waiting ones, a long prompt in chunks); a paged KV cache of
``kv_capacity_tokens`` in blocks, with a prefix cache that reuses a full block of the
same tokens, evicts the least recently freed block first and reports what it stores
and evicts (vLLM's KV events); preemption by recompute when blocks run out (the newest,
or under the priority policy the least urgent, running request gives its blocks back);
and requests whose prompt KV arrives from elsewhere (PD), which wait for it, spend
``kv_load_steps`` engine steps loading it (vLLM learns that an asynchronous load is
done from a step's output) and then compute only their last prompt token.

It keeps no clock: a caller asks for a step (``schedule``), spends the time a latency
profile gives for its ``StepShape``, and hands it back (``complete``). The real-time
engine (engines/simulated/host.py) and the offline simulator drive the same class.

Two modes replay vLLM 0.6.0's V0 engine (read in its sdist, commit
32e7db25365415841ebc7c4215851743fbb1bad1: vllm/core/scheduler.py, vllm/config.py,
vllm/engine/arg_utils.py, vllm/engine/async_llm_engine.py,
vllm/engine/output_processor/multi_step.py), for benchmarks run on it:

- ``chunked_prefill=False``: ``Scheduler._schedule_default``. While a waiting request
  can start, a step is whole prompts only (``_schedule_prefills``: FCFS, each charged
  its whole length to ``max_num_batched_tokens``, admission stopping at the first that
  does not fit the budget, ``max_num_seqs`` or the free blocks) and the running
  requests' decodes wait; otherwise a step is the running requests' decodes alone
  (``_schedule_running``), preempting the newest by recompute for blocks.
- ``scheduler_steps=k`` (``--num-scheduler-steps``): a decode step is a group of k
  model steps over the batch it started with (the engine reuses its cached scheduler
  output until every step ran); each request's blocks for all k tokens are reserved
  when it is scheduled (``num_lookahead_slots = k - 1``), and its tokens reach the
  client at the group's end only. A request that reaches max_tokens within a group
  stays in the batch to its end, its extra tokens dropped (``_process_seq_outputs``);
  one that arrives waits for the end. Prefill steps stay single steps
  (``_get_num_lookahead_slots(is_prefill=True)`` is 0). 0.6.0 refuses multi-step with
  chunked prefill, and so does ``SchedulerLimits``.

Left out of these: V0's watermark of free blocks kept back at admission (1%), its
worst-case count of blocks a decode touches, ``scheduler_delay_factor`` (0 by
default), swapping (only beam search swaps), prompts V0 ignores for their length (they
are refused when added instead), and async output processing, which overlaps a group's
output handling with the next group and so delivers its tokens a little later. Each
step of a group costs the profile's time for its shape: the per-step CPU work that
multi-step saves is in the profile's ``step_overhead_s``, if it was fitted on such an
engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from splitserve.latency.profile import StepShape

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    # The router's chained hash of each full prompt block (engines/kv_events.py).
    block_hashes: Sequence[int] = ()
    priority: int = 0
    arrival: float = 0.0
    # PD: the prompt's KV comes from a prefill engine; schedulable once it has.
    kv_from_elsewhere: bool = False
    kv_ready: bool = True
    load_steps_left: int = 0  # steps that load its arrived KV before it can compute
    # What the scheduler has done for it.
    computed: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    preemptions: int = 0
    started: bool = False
    # Leading prompt blocks already offered to the prefix cache.
    stored_blocks: int = 0

    @property
    def tokens_to_compute(self) -> int:
        """Prompt and, after a preemption, the output it recomputes."""
        return self.prompt_tokens + self.output_tokens

    @property
    def prefilling(self) -> bool:
        return self.output_tokens == 0 or self.computed < self.tokens_to_compute - 1


@dataclass(slots=True)
class ScheduledStep:
    # (request, tokens it runs this step), in the order they were scheduled.
    work: list[tuple[SimRequest, int]]
    shape: StepShape
    preempted: list[SimRequest]
    # Requests whose handed-over KV this step loads.
    loads: list[SimRequest] = field(default_factory=list)
    # Model steps it runs: a multi-step group of decodes runs scheduler_steps, all on
    # this batch and shape's first step, and hands its tokens back at its end.
    steps: int = 1


@dataclass(slots=True)
class StepResult:
    # Requests that got a token this step, and those of them that finished.
    sampled: list[SimRequest]
    finished: list[SimRequest]
    # How many tokens each sampled request got, by request id: one a step, so more for a
    # multi-step group or a run, and fewer for one that reached max_tokens within them.
    new_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class CacheEvents:
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class BlockPool:
    """Paged KV blocks with a prefix cache: a freed full block keeps its hash and can be
    reused by a later request with the same prefix until it is evicted for space."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # vLLM's free queue starts with every block in order and hands out its head; a
        # freed block joins its tail. So blocks never used go first, in order (counted,
        # not listed: an H100's cache has hundreds of thousands), then freed ones, least
        # recently freed first: the eviction order.
        self._never_used = 0  # blocks [_never_used, num_blocks) have never been handed out
        self._freed: OrderedDict[int, None] = OrderedDict()
        self._refs: dict[int, int] = {}  # blocks in use, by how many requests use them
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.events = CacheEvents()

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self._never_used + len(self._freed)

    @property
    def usage(self) -> float:
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0

    def cached_prefix(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt the cache holds."""
        hits = 0
        for block_hash in block_hashes:
            if block_hash not in self._block_of:
                break
            hits += 1
        return hits

    def take_cached(self, block_hashes: Sequence[int]) -> list[int]:
        blocks = [self._block_of[h] for h in block_hashes]
        refs = self._refs
        for block in blocks:
            if block not in refs:
                del self._freed[block]
                refs[block] = 0
            refs[block] += 1
        return blocks

    def allocate(self, count: int) -> list[int] | None:
        if count > self.free_blocks:
            return None
        fresh = min(count, self.num_blocks - self._never_used)
        blocks = list(range(self._never_used, self._never_used + fresh))
        self._never_used += fresh
        take, hash_of, block_of = self._freed.popitem, self._hash_of, self._block_of
        removed = self.events.removed
        for _ in range(count - fresh):
            block, _ = take(last=False)
            evicted = hash_of.pop(block, None)
            if evicted is not None:
                del block_of[evicted]
                removed.append(evicted)
            blocks.append(block)
        self._refs.update(dict.fromkeys(blocks, 1))
        return blocks

    def store(self, blocks: Sequence[int], block_hashes: Sequence[int]) -> None:
        """These blocks now hold full blocks of known tokens: later prompts may reuse them."""
        hash_of, block_of, stored = self._hash_of, self._block_of, self.events.stored
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block in hash_of or block_hash in block_of:
                continue
            hash_of[block] = block_hash
            block_of[block_hash] = block
            stored.append(block_hash)

    def free(self, blocks: Sequence[int]) -> None:
        # Last blocks first, as vLLM frees them: a prompt's tail is evicted before its head.
        refs = self._refs
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                del refs[block]
                self._freed[block] = None

    def cached_hashes(self) -> list[int]:
        return list(self._block_of)

    def take_events(self) -> CacheEvents:
        events, self.events = self.events, CacheEvents()
        return events


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True
    kv_load_steps: int = 1  # LatencyProfile.handover_load_steps
    # False: vLLM V0's scheduling without chunked prefill (the module's docstring).
    chunked_prefill: bool = True
    # Above 1: V0's multi-step scheduling, this many steps a decode group.
    scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.scheduler_steps < 1:
            raise ValueError(f"scheduler_steps must be at least 1, got {self.scheduler_steps}")
        if self.scheduler_steps > 1 and self.chunked_prefill:
            # vllm/engine/arg_utils.py of 0.6.0: "Chunked prefill is not supported with
            # multi-step (--num-scheduler-steps > 1)".
            raise ValueError(
                "scheduler_steps > 1 (vLLM V0's multi-step scheduling) needs chunked_prefill"
                " off, as vLLM 0.6.0 does"
            )


class SimScheduler:
    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self.blocks = BlockPool(limits.num_blocks)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self._by_id: dict[str, SimRequest] = {}
        # Waiting requests whose handed-over KV has arrived and is being loaded.
        self._loading: dict[str, SimRequest] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def check(self, request: SimRequest) -> None:
        """Raise ValueError for a request this engine can never run."""
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already running")
        limits = self.limits
        # The last sampled token is never fed back, so it needs no KV; a multi-step group
        # reserves its later steps' slots even past max_tokens.
        longest = request.prompt_tokens + request.max_tokens - 1
        needed = -(-(longest + limits.scheduler_steps - 1) // limits.block_size)
        if needed > limits.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {needed} KV blocks, more than the"
                f" engine's {limits.num_blocks}"
            )
        if not limits.chunked_prefill and longest > limits.max_num_batched_tokens:
            # Its prompt, or after a preemption prompt and output, is recomputed whole in
            # one step; vLLM V0 refuses a max_num_batched_tokens below max_model_len so.
            raise ValueError(
                f"request {request.request_id!r} may need {longest} tokens in one step"
                f" without chunked prefill, more than max_num_batched_tokens"
                f" {limits.max_num_batched_tokens}"
            )

    def add(self, request: SimRequest) -> None:
        self.check(request)
        self._by_id[request.request_id] = request
        if request.kv_from_elsewhere:
            request.load_steps_left = self.limits.kv_load_steps
            if request.kv_ready:
                self._start_loading(request)
        self.waiting.append(request)

    def kv_arrived(self, request_id: str) -> None:
        request = self._by_id.get(request_id)
        if request is not None:
            request.kv_ready = True
            self._start_loading(request)

    def _start_loading(self, request: SimRequest) -> None:
        if request.load_steps_left > 0:
            self._loading[request.request_id] = request

    def abort(self, request_id: str) -> SimRequest | None:
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        self._loading.pop(request_id, None)
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.blocks.free(request.blocks)
        request.blocks = []
        return request

    def schedule(self) -> ScheduledStep | None:
        """The next step's work, or None when nothing can run."""
        if not self.limits.chunked_prefill:
            return self._schedule_whole_prompts()
        work, preempted, budget = self._schedule_running()
        if not preempted:
            self._admit_waiting(budget, work)
        return self._step(work, preempted)

    def complete(self, step: ScheduledStep) -> StepResult:
        """The step ran, all its ``steps``: its tokens are computed, and each request past
        its prompt has sampled a token a step, up to its max_tokens."""
        return self.complete_run(step, step.steps)

    def decode_run_length(self, step: ScheduledStep) -> int:
        """How many steps exactly like ``step`` follow each other if nothing arrives: a
        batch of decodes only, with nothing waiting that could join it, runs unchanged
        until its first request finishes or its blocks run out, in whole multi-step
        groups (one that finishes within a group leaves at its end). ``step.steps`` for
        any other step."""
        group = step.steps
        if (
            step.shape.prefill_tokens
            or step.preempted
            or step.loads
            or len(step.work) != len(self.running)
        ):
            return group
        if len(self.running) < self.limits.max_num_seqs and any(r.kv_ready for r in self.waiting):
            return group
        groups = -(-min(r.max_tokens - r.output_tokens for r, _ in step.work) // group)
        size = self.limits.block_size
        while groups > 1:
            steps = groups * group
            needed = sum(-(-(r.computed + steps) // size) - len(r.blocks) for r, _ in step.work)
            if needed <= self.blocks.free_blocks:
                break
            groups //= 2
        return max(groups, 1) * group

    def complete_run(self, step: ScheduledStep, steps: int) -> StepResult:
        """``steps`` model steps of ``step``'s batch ran: its own, or a run of them that
        decode_run_length allows, in which each decode computed a token a step."""
        if steps % step.steps:
            raise ValueError(f"a run of {steps} steps cuts a group of {step.steps}")
        self._advance_loads(step.loads, steps)
        result = StepResult([], [])
        run = steps > step.steps  # past the blocks schedule reserved
        for request, tokens in step.work:
            if request.request_id not in self._by_id:
                continue  # aborted while the step ran
            if run and not self._grow(request, steps):
                raise RuntimeError("a decode run outgrew the blocks decode_run_length allowed")
            request.computed += tokens if steps == 1 else steps
            self._store_full_blocks(request)
            if request.computed < request.tokens_to_compute:
                continue  # a chunk of a longer prompt: no token yet
            count = min(steps, request.max_tokens - request.output_tokens)
            request.output_tokens += count
            result.sampled.append(request)
            result.new_tokens[request.request_id] = count
            if request.output_tokens >= request.max_tokens:
                result.finished.append(request)
                self._finish(request)
        return result

    def _advance_loads(self, loads: list[SimRequest], steps: int) -> None:
        for request in loads:
            request.load_steps_left -= steps
            if request.load_steps_left <= 0:
                self._loading.pop(request.request_id, None)

    def _step(
        self, work: list[tuple[SimRequest, int]], preempted: list[SimRequest], steps: int = 1
    ) -> ScheduledStep | None:
        loads = list(self._loading.values())
        if not work and not loads:
            return None
        return ScheduledStep(work, self._shape(work, len(loads)), preempted, loads, steps)

    def _schedule_running(
        self, lookahead: int = 0
    ) -> tuple[list[tuple[SimRequest, int]], list[SimRequest], int]:
        """The running requests' tokens within the budget, each with blocks for them and
        ``lookahead`` more (a multi-step group's later steps), preempting others for
        blocks: the work, the preempted and the budget left."""
        budget = self.limits.max_num_batched_tokens
        work: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        for request in list(self.running):
            if budget == 0:
                break
            if not request.started:  # preempted for an earlier one this step
                continue
            tokens = min(self._tokens_left(request), budget)
            victims = len(preempted)
            fits = self._make_room(request, tokens + lookahead, preempted)
            if len(preempted) > victims:
                # The priority policy may take back blocks of one scheduled already.
                work = [(r, t) for r, t in work if r.started]
                budget = self.limits.max_num_batched_tokens - sum(t for _, t in work)
            if fits:
                work.append((request, tokens))
                budget -= tokens
        return work, preempted, budget

    def _schedule_whole_prompts(self) -> ScheduledStep | None:
        """vLLM V0 without chunked prefill: whole prompts while any can start, else the
        running requests' decodes, for scheduler_steps steps."""
        work = self._admit_whole_prompts()
        if work:
            return self._step(work, [])
        steps = self.limits.scheduler_steps
        work, preempted, _ = self._schedule_running(lookahead=steps - 1)
        return self._step(work, preempted, steps if work else 1)

    def _admit_whole_prompts(self) -> list[tuple[SimRequest, int]]:
        """V0's _schedule_prefills without chunking: waiting requests in order, until one
        does not fit the token budget, max_num_seqs or the free blocks."""
        if self.limits.policy == "priority":
            self.waiting.sort(key=lambda r: (r.priority, r.arrival))
        budget = self.limits.max_num_batched_tokens
        work: list[tuple[SimRequest, int]] = []
        for request in self.waiting:
            if len(self.running) >= self.limits.max_num_seqs:
                break
            if not request.kv_ready or request.load_steps_left > 0:
                continue
            # V0 charges the whole sequence, its cached prefix too: unchunked, its
            # num_new_tokens is the sequence's length.
            charge = 1 if request.kv_from_elsewhere else request.tokens_to_compute
            if charge > budget:
                break
            if not request.started:
                self._start(request)
            tokens = self._tokens_left(request)
            if not self._grow(request, tokens):
                break
            self.running.append(request)
            work.append((request, tokens))
            budget -= charge
        for request, _ in work:
            self.waiting.remove(request)
        return work

    def _tokens_left(self, request: SimRequest) -> int:
        return max(1, request.tokens_to_compute - request.computed)

    def _admit_waiting(self, budget: int, work: list[tuple[SimRequest, int]]) -> None:
        if self.limits.policy == "priority":
            self.waiting.sort(key=lambda r: (r.priority, r.arrival))
        admitted: list[SimRequest] = []
        for request in self.waiting:
            if budget == 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if not request.kv_ready or request.load_steps_left > 0:
                continue
            if not request.started:
                self._start(request)
            tokens = min(self._tokens_left(request), budget)
            if not self._grow(request, tokens):
                break  # no blocks: it waits, as do those behind it
            self.running.append(request)
            admitted.append(request)
            work.append((request, tokens))
            budget -= tokens
        for request in admitted:
            self.waiting.remove(request)

    def _start(self, request: SimRequest) -> None:
        """First schedule: what of the prompt is cached, or arrived from elsewhere."""
        request.started = True
        if request.kv_from_elsewhere:
            # The transferred KV fills the prompt but its last token, which the engine
            # computes again to sample from (engines/continuation.py).
            request.computed = request.prompt_tokens - 1
            request.cached_tokens = request.computed
            return
        if not self.limits.enable_prefix_caching:
            return
        self.prefix_queries += request.prompt_tokens
        hits = self.blocks.cached_prefix(request.block_hashes)
        # At least one prompt token is computed, to sample from (vLLM drops a whole-prompt
        # hit's last block).
        if hits * self.limits.block_size >= request.prompt_tokens:
            hits -= 1
        if hits <= 0:
            return
        request.blocks = self.blocks.take_cached(request.block_hashes[:hits])
        request.computed = hits * self.limits.block_size
        request.cached_tokens = request.computed
        self.prefix_hits += request.computed

    def _grow(self, request: SimRequest, tokens: int) -> bool:
        size = self.limits.block_size
        needed = -(-(request.computed + tokens) // size) - len(request.blocks)
        if needed <= 0:
            return True
        blocks = self.blocks.allocate(needed)
        if blocks is None:
            return False
        request.blocks.extend(blocks)
        return True

    def _make_room(self, request: SimRequest, tokens: int, preempted: list[SimRequest]) -> bool:
        """Blocks for a running request's tokens, preempting others (or itself) for them."""
        while not self._grow(request, tokens):
            victim = self._victim()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _victim(self) -> SimRequest:
        if self.limits.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _preempt(self, request: SimRequest) -> None:
        self.running.remove(request)
        self.blocks.free(request.blocks)
        request.blocks = []
        request.computed = 0
        request.started = False
        request.stored_blocks = 0
        request.kv_from_elsewhere = False  # its transferred KV is gone: recompute it
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, request)

    def _store_full_blocks(self, request: SimRequest) -> None:
        if not self.limits.enable_prefix_caching:
            return
        full = min(request.computed // self.limits.block_size, len(request.block_hashes))
        done = request.stored_blocks
        if full > done:
            self.blocks.store(request.blocks[done:full], request.block_hashes[done:full])
            request.stored_blocks = full

    def _finish(self, request: SimRequest) -> None:
        del self._by_id[request.request_id]
        self.running.remove(request)
        self.blocks.free(request.blocks)
        request.blocks = []

    def _shape(self, work: list[tuple[SimRequest, int]], kv_loads: int = 0) -> StepShape:
        prefill_tokens = attention_pairs = prefill_seqs = decode_seqs = decode_context = 0
        for request, tokens in work:
            if request.prefilling:
                prefill_seqs += 1
                prefill_tokens += tokens
                attention_pairs += tokens * request.computed + tokens * (tokens + 1) // 2
            else:
                decode_seqs += 1
                decode_context += request.computed + 1
        return StepShape(
            prefill_tokens=prefill_tokens,
            attention_pairs=attention_pairs,
            prefill_seqs=prefill_seqs,
            decode_seqs=decode_seqs,
            decode_context_tokens=decode_context,
            kv_loads=kv_loads,
        )
