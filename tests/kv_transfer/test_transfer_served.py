"""Prefill → Ray object store → decode gives the same greedy tokens as one engine.

A Ray cluster of our own (never RAY_ADDRESS or another process's cluster) and two
engines in this process, as the router would drive them: the prefill engine (producer)
computes the prompt and the first token and returns a handle; the decode engine
(consumer) gets prompt + first token and the handle, loads the transferred blocks and
continues. The directory's counters prove the KV was loaded, not recomputed, and by
which path: pushed to the decode engine the prefill request named (the router's way),
or claimed by a decode engine that was not named.

The single-engine baseline runs on the prefill engine with plain requests (its
connector stays idle) and prefix caching off, so every baseline is a full computation.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from engines.host import _LatestSchedulerStats, _stat_logger_factory
from engines.socket_folders import VLLM_IPC_ENV
from engines.tiny_model import embedded_model_path
from kv_transfer import (
    KVLayoutMismatchError,
    ObjectStoreSettings,
    check_handle_compatible,
    consumer_id,
    get_kv_directory,
    release_handle,
    remote_decode_params,
    shutdown_kv_directory,
)
from kv_transfer.builtin_backends import ObjectStoreBackend
from kv_transfer.metrics import TransferTotals
from kv_transfer.object_store.directory import SWEEP_INTERVAL_S
from tests.support.local_ports import free_port

pytestmark = pytest.mark.serving

NAMESPACE = "splitserve-kv-test"
TTL_S = 4.0
# Long enough that a named decode engine always loads the pushed part, never a claim.
PUSH_WAIT_S = 5.0
# How long the directory may take to hear of a load (see _assert_counted).
LEDGER_SETTLE_S = 10.0
BLOCK_SIZE = 128  # vLLM's default on the CPU; see test_engine_block_size
MAX_TOKENS = 12
# 1 token; around one block of 16 (GPU default) and of 128 (CPU default); long prompts.
PROMPT_LENGTHS = (1, 15, 16, 17, 100, 127, 128, 129, 700, 1500)
# Tiny model: 2 layers x 2 KV heads x 128 slots x (32 K + 32 V) x fp32 per page.
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 64 * 4
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Engine processes must not be forks of this Ray driver.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "VLLM_LOGGING_LEVEL": "WARNING",
    # Our vLLM plugin ends engine processes whose parent (this test) is gone.
    "SPLITSERVE_ORPHAN_GUARD": "1",
}


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Our own Ray cluster; yields the address of its state API (list_objects needs it)."""
    saved = {key: os.environ.get(key) for key in ("RAY_ADDRESS", VLLM_IPC_ENV, *ENGINE_ENV)}
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.update(ENGINE_ENV)
    # These engines are not an engine host's: their IPC sockets go in the test's folder.
    os.environ[VLLM_IPC_ENV] = str(tmp_path_factory.mktemp("vllm-ipc"))
    try:  # a failed start must not leave this environment to the modules after this one
        context = ray.init(
            address="local",  # a new cluster, even if another one is running on this machine
            num_cpus=4,
            include_dashboard=True,
            dashboard_port=free_port(),
            namespace=NAMESPACE,
            log_to_driver=False,
        )
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # for engines
        yield f"http://{context.dashboard_url}"
    finally:
        if ray.is_initialized():
            shutdown_kv_directory(NAMESPACE)
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_engine(cpu: str, role: str, **engine_kwargs: Any) -> Any:
    from vllm import LLM

    # Read by the engine processes when they start; each engine gets its own core.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    engine = LLM(
        model=str(embedded_model_path()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        seed=0,
        kv_transfer_config=_object_store_config(
            role, namespace=NAMESPACE, ttl_s=TTL_S, push_wait_s=PUSH_WAIT_S
        ),
        disable_log_stats=False,  # SchedulerStats, which carry the connector's statistics
        **engine_kwargs,
    )
    engine.transfer_tap = _tap_transfer_stats(engine)  # type: ignore[attr-defined]  # the test's
    return engine


def _object_store_config(role: str, **settings: Any) -> dict[str, Any]:
    return ObjectStoreBackend(ObjectStoreSettings(**settings)).engine_config(role)  # type: ignore[arg-type]


def _stop_engine(engine: Any) -> None:
    from vllm.utils import system_utils  # the psutil vLLM's shutdown uses

    core = engine.llm_engine.engine_core
    try:
        core.shutdown()
    except system_utils.psutil.NoSuchProcess:
        # vLLM names each child process before killing it and suppresses only
        # ProcessLookupError; a child that exits in between aborts the shutdown (seen in
        # CI). The second pass no longer lists it and ends the rest.
        core.shutdown()


# Engines live per test class, so that at most two run at once on this small machine.
@pytest.fixture(scope="class")
def prefill(dashboard: str) -> Iterator[Any]:
    engine = _start_engine("0", "kv_producer", enable_prefix_caching=False)
    yield engine
    _stop_engine(engine)


@pytest.fixture(scope="class")
def decode(dashboard: str, prefill: Any) -> Iterator[Any]:
    engine = _start_engine("1", "kv_consumer", enable_prefix_caching=True)
    yield engine
    _stop_engine(engine)


@pytest.fixture(scope="class")
def prefill_tp2(dashboard: str) -> Iterator[Any]:
    engine = _start_engine("0|1", "kv_producer", enable_prefix_caching=False, **TP2)
    yield engine
    _stop_engine(engine)


@pytest.fixture(scope="class")
def decode_tp2(dashboard: str, prefill_tp2: Any) -> Iterator[Any]:
    engine = _start_engine("0|1", "kv_consumer", enable_prefix_caching=True, **TP2)
    yield engine
    _stop_engine(engine)


@pytest.fixture(scope="module")
def directory(dashboard: str) -> Any:
    return get_kv_directory(NAMESPACE)


def _prompt(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(256) for _ in range(length)]  # byte tokens of the tiny tokenizer


def _greedy(max_tokens: int, kv_transfer_params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
    )


def _generate(engine: Any, prompt: list[int], params: Any) -> Any:
    (output,) = engine.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return output


_baselines: dict[tuple[int, tuple[int, ...]], list[int]] = {}


def _single_engine_tokens(prefill: Any, prompt: list[int]) -> list[int]:
    # TP changes the order of floating-point sums, so each TP size has its own baseline.
    key = (prefill.llm_engine.vllm_config.parallel_config.tensor_parallel_size, tuple(prompt))
    if key not in _baselines:
        output = _generate(prefill, prompt, _greedy(MAX_TOKENS))
        _baselines[key] = list(output.outputs[0].token_ids)
    return _baselines[key]


def _prefill_step(
    prefill: Any, prompt: list[int], consumer: str | None = None
) -> tuple[int, dict[str, Any]]:
    """What the router does first: one token, and the handle for the decode engine."""
    output = _generate(prefill, prompt, _greedy(1, remote_decode_params(consumer)))
    (first_token,) = output.outputs[0].token_ids
    assert output.kv_transfer_params is not None, "the prefill engine returned no handle"
    return first_token, output.kv_transfer_params


def _decode_step(decode: Any, prompt: list[int], first_token: int, handle: dict) -> list[int]:
    output = _generate(decode, [*prompt, first_token], _greedy(MAX_TOKENS - 1, handle))
    return [first_token, *output.outputs[0].token_ids]


def _counters(directory: Any, decode: Any = None) -> dict[str, int]:
    """The directory's ledger (transfers by how they ended) and, given ``decode``, what
    that engine's host totals of its connector's statistics: parts by how they came,
    hand-overs and bytes loaded."""
    counters = dict(ray.get(directory.ledger_snapshot.remote())["transfers_total"])
    if decode is not None:
        totals = decode.transfer_tap.kv_transfer or TransferTotals()
        counters.update(totals.data["loads"])
        counters["get_handovers"] = totals.data["handovers"]["get"]
        counters["get_bytes"] = totals.data["bytes"]["get"]
    return counters


def _tap_transfer_stats(engine: Any) -> _LatestSchedulerStats:
    """The engine host's own stat logger on an offline engine (``LLM`` takes no stat
    loggers of its own): what vLLM carries of the connector's statistics, as the host
    totals them for the router."""
    latest = _LatestSchedulerStats()
    tap = _stat_logger_factory(latest)(engine.llm_engine.vllm_config)
    engine.llm_engine.logger_manager.stat_loggers.append(tap)
    return latest


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after if after[key] != before[key]}


def _one_load(path: str, blocks: int) -> dict[str, int]:
    """What one hand-over of ``blocks`` that a single decode rank got by ``path`` counts."""
    return {"loaded": 1, path: 1, "get_handovers": 1, "get_bytes": blocks * BYTES_PER_BLOCK}


def _assert_counted(
    before: dict[str, int], directory: Any, decode: Any, expected: dict[str, int]
) -> None:
    """The counts moved by ``expected`` since ``before``. A worker tells the directory
    that a part loaded without waiting for it (a Ray call it does not await), so the
    ledger may hear of the last load just after the request finished: give it
    LEDGER_SETTLE_S."""
    deadline = time.monotonic() + LEDGER_SETTLE_S
    delta = _delta(before, _counters(directory, decode))
    while delta != expected and time.monotonic() < deadline:
        time.sleep(0.05)
        delta = _delta(before, _counters(directory, decode))
    assert delta == expected


def _pd_tokens(prefill: Any, decode: Any, prompt: list[int], named: bool = True) -> list[int]:
    """``named``: the prefill request names the decode engine, as the router does."""
    first_token, handle = _prefill_step(prefill, prompt, _consumer(decode) if named else None)
    check_handle_compatible(handle, decode.llm_engine.vllm_config)
    return _decode_step(decode, prompt, first_token, handle)


def _consumer(decode: Any) -> str:
    consumer = consumer_id(decode.llm_engine.vllm_config)
    assert consumer is not None
    return consumer


def _pd_batch_tokens(prefill: Any, decode: Any, prompts: list[list[int]]) -> list[list[int]]:
    firsts = prefill.generate(
        [{"prompt_token_ids": prompt} for prompt in prompts],
        _greedy(1, remote_decode_params(_consumer(decode))),
        use_tqdm=False,
    )
    rests = decode.generate(
        [
            {"prompt_token_ids": [*prompt, first.outputs[0].token_ids[0]]}
            for prompt, first in zip(prompts, firsts, strict=True)
        ],
        [_greedy(MAX_TOKENS - 1, first.kv_transfer_params) for first in firsts],
        use_tqdm=False,
    )
    return [
        [first.outputs[0].token_ids[0], *rest.outputs[0].token_ids]
        for first, rest in zip(firsts, rests, strict=True)
    ]


class TestOneRankEachSide:
    def test_engine_block_size(self, prefill: Any, decode: Any) -> None:
        for engine in (prefill, decode):
            assert engine.llm_engine.vllm_config.cache_config.block_size == BLOCK_SIZE

    @pytest.mark.parametrize("length", PROMPT_LENGTHS)
    def test_pd_tokens_equal_single_engine(
        self, prefill: Any, decode: Any, directory: Any, length: int
    ) -> None:
        prompt = _prompt(length)
        expected = _single_engine_tokens(prefill, prompt)
        before = _counters(directory, decode)
        assert _pd_tokens(prefill, decode, prompt) == expected
        # Loaded (not recomputed): one transfer, pushed to the decode engine the prefill
        # request named, every block of the prompt written once.
        blocks = -(-length // BLOCK_SIZE)
        _assert_counted(before, directory, decode, _one_load("pushed", blocks))

    def test_unnamed_decode_engine_claims_the_part(
        self, prefill: Any, decode: Any, directory: Any
    ) -> None:
        """A handle that names no decode engine (or another one) is claimed on demand."""
        prompt = _prompt(333)
        expected = _single_engine_tokens(prefill, prompt)
        before = _counters(directory, decode)
        assert _pd_tokens(prefill, decode, prompt, named=False) == expected
        _assert_counted(before, directory, decode, _one_load("claimed", 3))

    def test_prefill_that_keeps_decoding_hands_over_its_prompt(
        self, prefill: Any, decode: Any, directory: Any
    ) -> None:
        """Not the router's way (it asks for one token), but a client may ask for more.

        The request is still running when its put starts, so its blocks are not yet
        held for the put: the next step waits for the put before its forward pass.
        """
        prompt = _prompt(450)
        expected = _single_engine_tokens(prefill, prompt)
        params = _greedy(4, remote_decode_params(_consumer(decode)))
        output = _generate(prefill, prompt, params)
        assert list(output.outputs[0].token_ids) == expected[:4]
        before = _counters(directory, decode)
        handle = output.kv_transfer_params
        assert _decode_step(decode, prompt, expected[0], handle) == expected
        _assert_counted(before, directory, decode, _one_load("pushed", 4))

    def test_concurrent_transfers(self, prefill: Any, decode: Any, directory: Any) -> None:
        """Several prompts prefilled in one batch, then loaded and decoded in one batch."""
        prompts = [_prompt(length) for length in (33, 257, 511, 900, 1200)]
        expected = [_single_engine_tokens(prefill, prompt) for prompt in prompts]
        before = _counters(directory, decode)
        assert _pd_batch_tokens(prefill, decode, prompts) == expected
        blocks = sum(-(-len(prompt) // BLOCK_SIZE) for prompt in prompts)
        _assert_counted(
            before,
            directory,
            decode,
            {
                "loaded": len(prompts),
                "pushed": len(prompts),
                "get_handovers": len(prompts),
                "get_bytes": blocks * BYTES_PER_BLOCK,
            },
        )

    @pytest.mark.parametrize(
        ("length", "blocks_loaded"),
        [(700, 1), (128, 0)],
        ids=["partial-tail-block-loaded", "every-block-cached-on-decode"],
    )
    def test_repeated_prompt_loads_only_what_decode_lacks(
        self, prefill: Any, decode: Any, directory: Any, length: int, blocks_loaded: int
    ) -> None:
        """The decode engine cached this prompt's full blocks from the earlier transfer."""
        prompt = _prompt(length)
        expected = _single_engine_tokens(prefill, prompt)
        before = _counters(directory, decode)
        assert _pd_tokens(prefill, decode, prompt) == expected
        loaded = _one_load("pushed", blocks_loaded)
        _assert_counted(before, directory, decode, loaded if blocks_loaded else {"released": 1})

    def test_layout_mismatch_is_refused_never_loaded(
        self, prefill: Any, decode: Any, directory: Any
    ) -> None:
        prompt = _prompt(300)
        expected = _single_engine_tokens(prefill, prompt)
        mismatched = _start_engine("1", "kv_consumer", block_size=64)
        try:
            first_token, handle = _prefill_step(prefill, prompt)
            # The decode host refuses it before submitting, naming what differs.
            with pytest.raises(KVLayoutMismatchError, match=r"block_size 128 != 64"):
                check_handle_compatible(handle, mismatched.llm_engine.vllm_config)
            # Submitted anyway, the connector refuses to load it: recomputed, same tokens.
            before = _counters(directory)
            assert _decode_step(mismatched, prompt, first_token, handle) == expected
            # The refusal reaches the directory actor without being awaited: wait for it.
            deadline = time.monotonic() + PUSH_WAIT_S
            while not _delta(before, _counters(directory)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _delta(before, _counters(directory)) == {"failed": 1}
        finally:
            _stop_engine(mismatched)

    def test_lost_transfer_is_recomputed(self, prefill: Any, decode: Any, directory: Any) -> None:
        """A handle whose objects are gone (released here) still decodes correctly."""
        prompt = _prompt(400)
        expected = _single_engine_tokens(prefill, prompt)
        first_token, handle = _prefill_step(prefill, prompt)
        ray.get(release_handle(handle))
        before = _counters(directory, decode)
        assert _decode_step(decode, prompt, first_token, handle) == expected
        assert _delta(before, _counters(directory, decode)) == {}  # already counted as released

    def test_unused_handles_are_freed(
        self, dashboard: str, prefill: Any, decode: Any, directory: Any
    ) -> None:
        """Also from the decode engine they were pushed to, which fetched them at once."""
        _, released = _prefill_step(prefill, _prompt(200), _consumer(decode))
        # Never decoded or released.
        _, _abandoned = _prefill_step(prefill, _prompt(250), _consumer(decode))
        held = _wait_for_registrations(directory, 2)
        assert len(held) == 2
        assert set(held) <= {entry.object_id for entry in _objects(dashboard)}
        before = _counters(directory)
        ray.get(release_handle(released))
        time.sleep(TTL_S + 3 * SWEEP_INTERVAL_S)
        assert _delta(before, _counters(directory)) == {"released": 1, "expired": 1}
        _assert_object_store_empty(dashboard, directory)


class TestTensorParallelTwo:
    """TP=2 on both sides: each rank puts and loads its own shard (one KV head here)."""

    @pytest.mark.parametrize("length", (129, 1500))
    def test_pd_tokens_equal_single_engine(
        self, prefill_tp2: Any, decode_tp2: Any, directory: Any, length: int
    ) -> None:
        prompt = _prompt(length)
        expected = _single_engine_tokens(prefill_tp2, prompt)
        before = _counters(directory, decode_tp2)
        assert _pd_tokens(prefill_tp2, decode_tp2, prompt) == expected
        blocks = -(-length // BLOCK_SIZE)  # two shards of half a block's bytes each
        _assert_counted(
            before,
            directory,
            decode_tp2,
            {
                "loaded": 1,
                "pushed": 2,  # one part per rank
                "get_handovers": 1,  # counted by the first rank's
                "get_bytes": blocks * BYTES_PER_BLOCK,
            },
        )

    def test_tp_mismatch_is_refused(self, prefill_tp2: Any) -> None:
        from vllm.engine.arg_utils import EngineArgs

        # A TP=1 decode engine's config, without starting one.
        tp1_config = EngineArgs(
            model=str(embedded_model_path()),
            dtype="float32",
            max_model_len=4096,
            kv_transfer_config=_object_store_config(  # type: ignore[arg-type]  # vLLM parses dicts
                "kv_consumer", namespace=NAMESPACE
            ),
        ).create_engine_config()
        _, handle = _prefill_step(prefill_tp2, _prompt(50))
        try:
            with pytest.raises(
                KVLayoutMismatchError, match=r"kv_heads_per_rank 1 != 2.*tp_size 2 != 1"
            ):
                check_handle_compatible(handle, tp1_config)
        finally:
            ray.get(release_handle(handle))


def test_directory_pushes_only_to_the_named_consumer(directory: Any) -> None:
    """The directory's side of a push, without engines: who gets a part, and when."""
    part = ray.put(b"kv pages")
    layout = {"num_layers": 1}

    def register(transfer_id: str, consumer: str) -> None:
        args = (transfer_id, 0, 1, [part], 8, layout, TTL_S, consumer)
        assert ray.get(directory.register.remote(*args))

    def deliveries(consumer: str, held: list[str]) -> dict[str, Any]:
        return ray.get(directory.deliveries.remote(consumer, 0, held, 0.2))

    register("t-before-poll", "late")  # its consumer has not polled yet: no inbox
    for consumer in ("named", "other", "late"):
        assert deliveries(consumer, []) == {"parts": {}, "closed": []}
    register("t-named", "named")
    pushed = deliveries("named", [])
    assert list(pushed["parts"]) == ["t-named"]
    assert pushed["parts"]["t-named"]["layout"] == layout
    assert deliveries("other", []) == {"parts": {}, "closed": []}
    assert deliveries("late", []) == {"parts": {}, "closed": []}
    # A consumer holding a part hears when its transfer closes, and may drop it.
    assert deliveries("named", ["t-named"])["closed"] == []
    for transfer_id in ("t-named", "t-before-poll"):
        ray.get(directory.release.remote(transfer_id))
    assert deliveries("named", ["t-named"]) == {"parts": {}, "closed": ["t-named"]}


def test_object_store_is_empty_at_the_end(dashboard: str, directory: Any) -> None:
    time.sleep(TTL_S + 3 * SWEEP_INTERVAL_S)  # whatever a failed test left behind expires
    _assert_object_store_empty(dashboard, directory)


def _wait_for_registrations(directory: Any, count: int) -> list[str]:
    """The directory's objects once ``count`` are registered (producers do not wait)."""
    deadline = time.monotonic() + 10
    while True:
        held = ray.get(directory.live_object_ids.remote())
        if len(held) >= count or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def _assert_object_store_empty(dashboard: str, directory: Any) -> None:
    assert ray.get(directory.live_object_ids.remote()) == []
    snapshot = ray.get(directory.ledger_snapshot.remote())
    assert (snapshot["live_transfers"], snapshot["live_bytes"]) == (0, 0)
    # Engine processes put only KV parts, and nothing else here is a block's size.
    leftovers = [
        (entry.object_id, entry.object_size, entry.reference_type)
        for entry in _objects(dashboard)
        if (entry.object_size or 0) >= BYTES_PER_BLOCK // 2
    ]
    assert leftovers == []


def _objects(dashboard: str) -> list[Any]:
    from ray.util.state import list_objects

    # Ray's "data truncation" check compares per-worker reference counts with the
    # deduplicated table and fails without anything missing; the limit is not reached.
    return list_objects(address=dashboard, limit=10_000, detail=True, raise_on_missing_output=False)
