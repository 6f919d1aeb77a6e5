"""A simulated engine's metrics under vLLM's own names, labels and buckets.

The engine hands vLLM's Ray stat logger (the one every vLLM engine replica uses,
engines/metrics.py ``replica_stat_logger``) vLLM's own stats objects for each step:
running and waiting requests, KV cache usage, prefix-cache queries and hits, prompt
tokens by source, generated tokens, time to first token, inter-token latency, and each
finished request. So Ray's metrics endpoint exports ``ray_vllm_*`` for simulated engines
as for real ones, and the dashboard reads them unchanged. Times are the wall clock's, as
the router's are: with ``engine.time_scale`` they are stretched as the engine is.

Only inside a Ray worker (where ``ray.util.metrics`` exports anything); the logger
needs vLLM's configuration of the model, built once at start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engines.settings import EngineSpec
from engines.simulated.settings import V0_SCHEDULING_ARGS


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class SimulatedEngineMetrics:
    def __init__(self, spec: EngineSpec) -> None:
        from engines.host import build_engine_args
        from engines.metrics import replica_stat_logger

        # One rank's configuration without a KV connector: the metrics depend on neither,
        # a CPU box may not validate a GPU pool's degrees, and the simulated hand-over
        # names no connector of vLLM's. Nor V0's scheduling, which the installed vLLM may
        # refuse or not have.
        kwargs = {k: v for k, v in spec.pool.engine_kwargs.items() if k not in V0_SCHEDULING_ARGS}
        degrees = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
        pool = spec.pool.model_copy(update={**degrees, "engine_kwargs": kwargs})
        alone = spec.model_copy(update={"pool": pool, "kv_transfer": None, "kv_events": False})
        vllm_config = build_engine_args(alone).create_engine_config()
        self._logger = replica_stat_logger(spec.name, spec.role)(vllm_config, [0])
        self._times: dict[str, RequestTimes] = {}
        self._queries = 0
        self._hits = 0

    def arrived(self, request_id: str) -> None:
        self._times[request_id] = RequestTimes(time.monotonic())

    def forget(self, request_id: str) -> None:
        self._times.pop(request_id, None)

    def step(
        self,
        scheduler: Any,
        sampled: list[Any],
        finished: list[Any],
        prompt_sources: dict[str, int],
        new_tokens: dict[str, int] | None = None,
    ) -> None:
        """One step's stats: ``sampled`` requests got a token (or ``new_tokens`` of them,
        by request id: a multi-step group's), ``finished`` ended; ``prompt_sources``:
        prompt tokens by vLLM's source, of prompts done this step."""
        from vllm.v1.engine import FinishReason
        from vllm.v1.metrics.stats import (
            FinishedRequestStats,
            IterationStats,
            PrefixCacheStats,
            SchedulerStats,
        )

        now = time.monotonic()
        iteration = IterationStats()
        prompt = iteration.prompt_token_stats
        prompt.computed = prompt_sources.get("local_compute", 0)
        prompt.local_cache_hit = prompt_sources.get("local_cache_hit", 0)
        prompt.external_kv_transfer = prompt_sources.get("external_kv_transfer", 0)
        prompt.cached_tokens = prompt.local_cache_hit + prompt.external_kv_transfer
        prompt.total = prompt.computed + prompt.cached_tokens
        for request in sampled:
            times = self._times.get(request.request_id)
            if times is None:
                continue
            iteration.num_generation_tokens += (new_tokens or {}).get(request.request_id, 1)
            if times.first_token is None:
                times.first_token = now
                iteration.time_to_first_tokens_iter.append(now - times.arrival)
            elif times.last_token is not None:
                iteration.inter_token_latencies_iter.append(now - times.last_token)
            times.last_token = now
        for request in finished:
            times = self._times.pop(request.request_id, None)
            if times is None or times.first_token is None:
                continue
            decode = now - times.first_token
            iteration.finished_requests.append(
                FinishedRequestStats(
                    finish_reason=FinishReason.LENGTH,
                    request_id=request.request_id,
                    e2e_latency=now - times.arrival,
                    num_prompt_tokens=request.prompt_tokens,
                    num_preemptions=request.preemptions,
                    num_generation_tokens=request.output_tokens,
                    max_tokens_param=request.max_tokens,
                    prefill_time=times.first_token - times.arrival,
                    inference_time=now - times.arrival,
                    decode_time=decode,
                    mean_time_per_output_token=decode / max(1, request.output_tokens - 1),
                    num_cached_tokens=request.cached_tokens,
                )
            )
        queries = scheduler.prefix_queries - self._queries
        hits = scheduler.prefix_hits - self._hits
        self._queries, self._hits = scheduler.prefix_queries, scheduler.prefix_hits
        stats = SchedulerStats(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            kv_cache_usage=scheduler.blocks.usage,
            prefix_cache_stats=PrefixCacheStats(queries=queries, hits=hits),
        )
        self._logger.record(stats, iteration, engine_idx=0)
