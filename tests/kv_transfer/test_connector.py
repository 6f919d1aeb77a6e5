"""The KV connector's halves without a Ray cluster or a vLLM engine: the paged-cache copy,
the directory, the worker half's put, push and claim, the scheduler half's orders.

The serving tests (tests/kv_transfer/test_transfer_served.py,
tests/deployments/test_pd_served.py) run the same code in real engines through Ray;
these check its branches in seconds. Where a step is not
awaited by the code under test (a registration, a push, a sweep), the test waits for
its effect, not for a span of time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

from kv_transfer.handle import LayoutFingerprint, TransferHandle, prompt_digest
from kv_transfer.object_store.metadata import LoadOrder, SaveOrder
from kv_transfer.object_store.paged_cache import (
    PagedKVCache,
    UnsupportedKVCacheError,
    contiguous_runs,
)
from kv_transfer.object_store.scheduler import TransferScheduler
from kv_transfer.object_store.worker import TransferWorker
from kv_transfer.settings import ObjectStoreSettings
from tests.support.kv_doubles import DirectoryLoop, LocalActor, MemoryObjectStore, directory_loop

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

BLOCK = 4
SHAPE = (16, 2, BLOCK, 8)  # blocks, kv heads, block size, 2 x head size: the CPU layout
SETTINGS = ObjectStoreSettings(ttl_s=5.0, claim_wait_s=0.2, push_wait_s=0.5)
# Waits on a condition give up after this long: a guard against a hang, not a pace.
WAIT_S = 30.0
PUSH_WAITING = SETTINGS.model_copy(update={"push_wait_s": WAIT_S / 2})
LAYOUT = LayoutFingerprint(
    model="tiny", kv_dtype="float32", block_size=BLOCK, num_layers=2,
    kv_heads_per_rank=2, head_size=4, tp_size=1, pp_size=1,
)  # fmt: skip


def _caches(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(SHAPE, generator=generator) for i in range(layers)}


# ---- paged cache -------------------------------------------------------------------------


def test_runs_merge_consecutive_blocks() -> None:
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(3, 6), (9, 11), (2, 3)]
    assert contiguous_runs([]) == []


def test_pack_and_unpack_copy_every_layer_block_for_block() -> None:
    source, target = _caches(1), _caches(2)
    packed = PagedKVCache(source, BLOCK).pack([5, 6, 7, 1])
    written = PagedKVCache(target, BLOCK).unpack(packed, 1, [10, 11, 3])  # skip block 5
    page = SHAPE[1] * SHAPE[2] * SHAPE[3] * 4
    assert written == 3 * page * 2
    for name in source:
        for src, dst in zip([6, 7, 1], [10, 11, 3], strict=True):
            assert torch.equal(source[name][src], target[name][dst])
        assert not torch.equal(source[name][5], target[name][0])


def test_unpack_refuses_pages_of_another_shape() -> None:
    other = {name: t[:, :1].contiguous() for name, t in _caches(3).items()}
    packed = PagedKVCache(other, BLOCK).pack([0])
    with pytest.raises(ValueError, match="does not fit"):
        PagedKVCache(_caches(4), BLOCK).unpack(packed, 0, [0])


# ---- directory, worker half --------------------------------------------------------------


@pytest.fixture
def loop() -> Iterator[DirectoryLoop]:
    yield from directory_loop()


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; WAIT_S is a guard against a hang, not a pace."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.01)


def _metrics(directory: LocalActor) -> dict[str, Any]:
    return directory.call("ledger_snapshot")


class WatchedDirectory(LocalActor):
    """The directory as a consumer rank calls it, noting when the rank's standing
    ``deliveries`` call is in (that call opens its inbox: pushes before it are lost)."""

    def __init__(self, directory: LocalActor) -> None:
        super().__init__(directory.loop, directory.instance)
        self.inbox_open = threading.Event()

    @property
    def deliveries(self) -> SimpleNamespace:
        return SimpleNamespace(remote=self._deliveries)

    def _deliveries(self, *args: Any) -> concurrent.futures.Future[Any]:
        async def call() -> Any:
            answer = self.instance.deliveries(*args)
            # The call's first step, which opens the inbox, runs on the directory's loop
            # before that loop runs anything another thread sends it (a registration).
            self.inbox_open.set()
            return await answer

        return asyncio.run_coroutine_threadsafe(call(), self.loop)


class Pair:
    """A producer rank and a consumer rank sharing one store and one directory."""

    def __init__(
        self,
        loop: DirectoryLoop,
        consumer: str | None = None,
        settings: ObjectStoreSettings = SETTINGS,
    ) -> None:
        self.store = MemoryObjectStore()
        self.directory = loop.directory()
        self.watched = WatchedDirectory(self.directory)
        self.source, self.target = _caches(5), _caches(6)
        self.producer = TransferWorker(0, BLOCK, settings, None, self.store, self.directory)
        self.consumer = TransferWorker(0, BLOCK, settings, consumer, self.store, self.watched)
        self.producer.register_kv_caches(self.source)
        self.consumer.register_kv_caches(self.target)
        # One block of every layer: K and V pages of SHAPE[1:] floats.
        self.producer_cache_block_bytes = len(self.source) * SHAPE[1] * SHAPE[2] * SHAPE[3] * 4

    def save(self, transfer_id: str, blocks: list[int], consumer: str | None = None) -> None:
        order = SaveOrder("req-p", transfer_id, blocks, 1, SETTINGS.ttl_s, consumer)
        self.producer.save([order])
        self.producer.settle_saves([])  # waits for the put: its request is not finished
        # The registration is not awaited by the producer: wait until the directory has it.
        _wait_until(lambda: _metrics(self.directory)["live_transfers"] == 1, "the part registered")

    def load(self, order: LoadOrder) -> set[str]:
        self.consumer.start_loads([order])
        finished: set[str] = set()

        def done() -> bool:
            finished.update(self.consumer.transfer_results().finished_recving or ())
            return bool(finished)

        _wait_until(done, f"load of {order.transfer_id}")
        return finished

    def close(self) -> None:
        self.producer.shutdown()
        self.consumer.shutdown()


def test_a_claimed_part_lands_in_the_consumers_pages_and_is_freed(loop: DirectoryLoop) -> None:
    pair = Pair(loop)
    try:
        pair.save("t1", [2, 3, 4])
        assert pair.load(LoadOrder("req-d", "t1", 0, [7, 8, 9])) == {"req-d"}
        assert pair.consumer.take_load_errors() == set()
        for name in pair.source:
            assert torch.equal(pair.source[name][2:5], pair.target[name][7:10])
        snapshot = _metrics(pair.directory)
        assert snapshot["transfers_total"]["loaded"] == 1
        assert snapshot["live_transfers"] == 0  # every part loaded: the refs are dropped
        # Each rank counts its own side, for vLLM to carry (get_kv_connector_stats).
        put, got = pair.producer.take_stats(), pair.consumer.take_stats()
        assert put is not None and got is not None
        nbytes = 3 * pair.producer_cache_block_bytes
        assert (put.data["bytes"], put.data["handovers"]) == (
            {"put": nbytes, "get": 0},
            {"put": 1, "get": 0},
        )
        assert (got.data["bytes"], got.data["loads"]) == (
            {"put": 0, "get": nbytes},
            {"pushed": 0, "claimed": 1},
        )
        assert sum(got.data["seconds_buckets"]["get"]) == 1
        # Taken means started afresh: nothing moved since.
        assert pair.producer.take_stats() is None and pair.consumer.take_stats() is None
    finally:
        pair.close()


def test_a_part_pushed_to_its_named_consumer_needs_no_claim(loop: DirectoryLoop) -> None:
    # The load waits for the push as long as the test waits for anything: it takes the
    # part the moment it arrives, and a push that never comes still fails the test.
    pair = Pair(loop, consumer="decode-0", settings=PUSH_WAITING)
    try:
        assert pair.watched.inbox_open.wait(WAIT_S), "the consumer never polled its inbox"
        pair.save("t2", [0, 1], consumer="decode-0")
        assert pair.load(LoadOrder("req-d", "t2", 0, [5, 6], pushed=True)) == {"req-d"}
        stats = pair.consumer.take_stats()
        assert stats is not None and stats.data["loads"] == {"pushed": 1, "claimed": 0}
        for name in pair.source:
            assert torch.equal(pair.source[name][0:2], pair.target[name][5:7])
    finally:
        pair.close()


def test_a_lost_transfer_is_a_load_error_and_the_blocks_are_recomputed(
    loop: DirectoryLoop,
) -> None:
    pair = Pair(loop)
    try:
        before = {name: t.clone() for name, t in pair.target.items()}
        assert pair.load(LoadOrder("req-d", "never-put", 0, [3, 4])) == {"req-d"}
        assert pair.consumer.take_load_errors() == {3, 4}
        assert all(torch.equal(before[n], pair.target[n]) for n in before)
        assert _metrics(pair.directory)["transfers_total"]["failed"] == 1
        assert pair.consumer.take_stats() is None  # nothing loaded, nothing counted
    finally:
        pair.close()


def test_a_put_is_reported_done_only_after_vllm_finished_its_request(loop: DirectoryLoop) -> None:
    pair = Pair(loop)
    try:
        pair.save("t3", [1])
        assert not pair.producer.transfer_results().finished_sending
        pair.producer.settle_saves(["req-p"])
        assert pair.producer.transfer_results().finished_sending == {"req-p"}
    finally:
        pair.close()


def test_released_and_expired_transfers_are_closed(loop: DirectoryLoop) -> None:
    directory = loop.directory()
    store = MemoryObjectStore()
    ref = store.put(np.zeros(4))
    for transfer_id, ttl_s in (("released", 60.0), ("expired", 0.1)):
        directory.call("register", transfer_id, 0, 1, [ref], 32, {}, ttl_s)
    directory.call("release", "released")
    # Released at once; expired once a sweep finds it past its TTL.
    _wait_until(lambda: _metrics(directory)["live_transfers"] == 0, "the expired part swept")
    assert directory.call("claim", "released", 0, 0.0) == {"status": "released"}
    assert directory.call("claim", "expired", 0, 0.0) == {"status": "expired"}
    assert directory.call("claim", "unheard-of", 0, 0.05) == {"status": "unknown"}
    assert _metrics(directory)["live_transfers"] == 0


def test_a_release_that_overtakes_the_registration_lets_the_part_go(loop: DirectoryLoop) -> None:
    directory = loop.directory()
    directory.call("release", "early")
    assert directory.call("register", "early", 0, 1, ["ref"], 32, {}, 60.0) is False
    assert _metrics(directory)["live_transfers"] == 0


# ---- scheduler half ------------------------------------------------------------------------


class RecordingDirectory:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=lambda *args: self.calls.append((name, args)))


def _request(request_id: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        num_computed_tokens=0,
        kv_transfer_params=params,
        status=RequestStatus.RUNNING,
    )


def _scheduler(directory: RecordingDirectory, producer: bool) -> TransferScheduler:
    scheduler = TransferScheduler(
        "engine-abcdef", LAYOUT, SETTINGS, producer, not producer, directory=directory
    )
    blocks = {"p1": [7, 8, 9, 10]}
    scheduler.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (blocks[rid],)))  # type: ignore[arg-type]
    return scheduler


def _scheduled(tokens: dict[str, int]) -> SchedulerOutput:
    """A step's scheduler output, as far as the connector's scheduler half reads it."""
    return SimpleNamespace(num_scheduled_tokens=tokens)  # type: ignore[return-value]


def test_the_producer_orders_the_put_when_the_prompt_completes_and_hands_a_handle() -> None:
    directory = RecordingDirectory()
    scheduler = _scheduler(directory, producer=True)
    prompt = list(range(10))  # 3 blocks of 4
    request = _request("p1", prompt, {"do_remote_decode": True, "splitserve_consumer": "d-0"})
    scheduler.on_new_request(request)
    first = scheduler.build_connector_meta(_scheduled({"p1": 8}))
    assert first.saves == []  # a chunk of the prompt: saved with the last chunk
    request.num_computed_tokens = 8
    orders = scheduler.build_connector_meta(_scheduled({"p1": 2}))
    (save,) = orders.saves
    assert (save.block_ids, save.consumer, save.num_parts) == ([7, 8, 9], "d-0", 1)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay_free, params = scheduler.request_finished(request)
    assert delay_free
    handle = TransferHandle.from_params(params)  # type: ignore[arg-type]
    assert (handle.transfer_id, handle.num_tokens) == (save.transfer_id, 10)
    assert handle.prompt_digest == prompt_digest(prompt) and handle.consumer == "d-0"
    assert scheduler.build_connector_meta(_scheduled({})).finished_saves == ["p1"]


def test_a_prefill_aborted_after_its_put_releases_the_transfer() -> None:
    directory = RecordingDirectory()
    scheduler = _scheduler(directory, producer=True)
    request = _request("p1", list(range(8)), {"do_remote_decode": True})
    scheduler.on_new_request(request)
    (save,) = scheduler.build_connector_meta(_scheduled({"p1": 8})).saves
    request.status = RequestStatus.FINISHED_ABORTED
    assert scheduler.request_finished(request) == (True, None)
    assert ("release", (save.transfer_id,)) in directory.calls


def _handle(prompt: list[int], num_tokens: int, **changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "transfer_id": "t9", "producer": "engine-p", "namespace": SETTINGS.namespace,
        "num_tokens": num_tokens, "prompt_digest": prompt_digest(prompt[:num_tokens]),
        "num_parts": 1, "layout": LAYOUT, "expires_at": time.time() + 60,
        "consumer": "engine-abcdef",
    }  # fmt: skip
    fields.update(changes)
    return TransferHandle(**fields).to_params()


def test_the_consumer_loads_what_its_prefix_cache_lacks_from_the_named_push() -> None:
    directory = RecordingDirectory()
    scheduler = _scheduler(directory, producer=False)
    prompt = list(range(11))
    request = _request("d1", [*prompt, 99], _handle(prompt, 11))
    assert scheduler.get_num_new_matched_tokens(request, 4) == (7, True)  # one block cached
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23],))
    scheduler.update_state_after_alloc(request, blocks, 7)  # type: ignore[arg-type]
    (load,) = scheduler.build_connector_meta(_scheduled({})).loads
    assert (load.first_source_block, load.block_ids, load.pushed) == (1, [21, 22], True)
    assert load.problem is None
    assert request.kv_transfer_params["do_remote_prefill"] is False  # one load, ever


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"prompt_digest": "0" * 32}, "not the one"),
        ({"namespace": "elsewhere"}, "namespace"),
        ({"layout": LAYOUT.model_copy(update={"block_size": 16})}, "block_size"),
    ],
)
def test_a_handle_for_another_prompt_or_layout_is_refused_and_failed(
    changes: dict[str, Any], reason: str
) -> None:
    directory = RecordingDirectory()
    scheduler = _scheduler(directory, producer=False)
    prompt = list(range(8))
    request = _request("d1", [*prompt, 99], _handle(prompt, 8, **changes))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, SimpleNamespace(), 0)  # type: ignore[arg-type]
    (call,) = directory.calls
    assert call[0] == "fail" and reason in call[1][1]


def test_a_fully_cached_prompt_releases_the_transfer_unloaded() -> None:
    directory = RecordingDirectory()
    scheduler = _scheduler(directory, producer=False)
    prompt = list(range(8))
    request = _request("d1", [*prompt, 99], _handle(prompt, 8))
    assert scheduler.get_num_new_matched_tokens(request, 8) == (0, False)
    scheduler.update_state_after_alloc(request, SimpleNamespace(), 0)  # type: ignore[arg-type]
    assert directory.calls == [("release", ("t9",))]


# ---- every KV layout of vLLM's attention backends, CPU tensors shaped like them --------

LAYOUTS = [layout.name for layout in KVCacheLayout]


def _backend_caches(
    layout: str,
    seed: int,
    layers: int = 3,
    blocks: int = 11,
    heads: int = 2,
    tokens: int = BLOCK,
    content: int = 8,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views of one allocation laid out as ``layout`` says
    (vLLM's own KVCacheLayout stride orders), as vLLM hands them to a connector."""
    order = KVCacheLayout[layout].stride_order  # logical axes in physical order
    logical = (layers, blocks, heads, tokens, content)
    generator = torch.Generator().manual_seed(seed)
    physical = torch.randn([logical[axis] for axis in order], generator=generator).to(dtype)
    view = physical.permute([order.index(axis) for axis in range(5)])
    return {f"layer.{i}": view[i] for i in range(layers)}


def _equal_blocks(a: torch.Tensor, a_ids: list[int], b: torch.Tensor, b_ids: list[int]) -> bool:
    return all(torch.equal(a[x], b[y]) for x, y in zip(a_ids, b_ids, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_byte_exact(layout: str, dtype: torch.dtype) -> None:
    source, target = (
        _backend_caches(layout, 1, dtype=dtype),
        _backend_caches(layout, 2, dtype=dtype),
    )
    sent = [9, 2, 3, 4, 7, 0, 10]  # an odd count, out of order, one run of three
    packed = PagedKVCache(source, BLOCK, layout).pack(sent)
    landing = [1, 5, 6, 8, 3]
    PagedKVCache(target, BLOCK, layout).unpack(packed, 2, landing)  # from the third on
    for name in source:
        assert _equal_blocks(source[name], sent[2:], target[name], landing)


def test_only_the_cpu_backends_contiguous_layout_moves_as_views() -> None:
    assert PagedKVCache(_backend_caches("LBHNC", 1), BLOCK).moves_views
    for layout in ("LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"):
        assert not PagedKVCache(_backend_caches(layout, 1), BLOCK).moves_views, layout


@pytest.mark.parametrize(
    ("source_layout", "target_layout"), [("LBNHC", "BLHNC"), ("BLHNC", "LBHNC")]
)
def test_a_prefill_backend_hands_kv_to_a_decode_backend_of_another_layout(
    source_layout: str, target_layout: str
) -> None:
    """FlashAttention's token-major pages into FlashInfer's block-outermost ones, and a
    GPU layout into the CPU backend's: parts travel in the logical order."""
    source = _backend_caches(source_layout, 3)
    target = _backend_caches(target_layout, 4)
    sending, receiving = PagedKVCache(source, BLOCK), PagedKVCache(target, BLOCK)
    assert sending.layout == receiving.layout
    receiving.unpack(sending.pack([4, 5, 6]), 0, [0, 9, 1])
    for name in source:
        assert _equal_blocks(source[name], [4, 5, 6], target[name], [0, 9, 1])


def test_kernel_blocks_smaller_than_the_schedulers_move_together() -> None:
    """A kernel that splits each 8-token scheduler block into two of 4 tokens."""
    source = _backend_caches("LBNHC", 5, blocks=12, tokens=4)
    target = _backend_caches("LBNHC", 6, blocks=12, tokens=4)
    cache = PagedKVCache(source, block_size=8)
    assert cache.layout["kernel_blocks_per_block"] == 2
    PagedKVCache(target, block_size=8).unpack(cache.pack([1, 4]), 0, [2, 0])
    for name in source:
        assert _equal_blocks(source[name], [2, 3, 8, 9], target[name], [4, 5, 0, 1])


def test_tensor_parallel_ranks_move_their_own_heads() -> None:
    """Two TP ranks, each holding half the KV heads, each with a part of its own."""
    for rank in range(2):
        source = _backend_caches("LBNHC", 10 + rank, heads=1)
        target = _backend_caches("LBNHC", 20 + rank, heads=1)
        PagedKVCache(target, BLOCK).unpack(PagedKVCache(source, BLOCK).pack([3, 1]), 0, [7, 8])
        for name in source:
            assert _equal_blocks(source[name], [3, 1], target[name], [7, 8])


def test_unsupported_caches_are_refused_with_the_backend_named() -> None:
    flat = {"layer.0": torch.zeros(16, 64)}
    with pytest.raises(UnsupportedKVCacheError, match="FLASHMLA"):
        PagedKVCache(flat, BLOCK, backend="FLASHMLA")
    meta = {"layer.0": torch.empty(SHAPE, device="meta")}
    with pytest.raises(UnsupportedKVCacheError, match="meta"):
        PagedKVCache(meta, BLOCK, backend="X")
    with pytest.raises(UnsupportedKVCacheError, match="do not divide"):
        PagedKVCache(_backend_caches("LBHNC", 1, tokens=3), 8, backend="X")


def test_pages_of_another_shape_are_refused_on_the_gather_path() -> None:
    packed = PagedKVCache(_backend_caches("LBNHC", 1, heads=1), BLOCK).pack([0])
    with pytest.raises(ValueError, match="do not fit"):
        PagedKVCache(_backend_caches("LBNHC", 2, heads=2), BLOCK).unpack(packed, 0, [0])


def test_mla_models_are_refused_at_start_with_the_backend_named() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from kv_transfer.object_store.connector import _check_supported

    def configs(spec: Any) -> tuple[Any, Any]:
        vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(
                pipeline_parallel_size=1,
                decode_context_parallel_size=1,
                prefill_context_parallel_size=1,
            ),
            attention_config=SimpleNamespace(backend=SimpleNamespace(name="FLASHMLA")),
            cache_config=SimpleNamespace(kv_cache_layout="LBHNC"),
        )
        kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)])
        return vllm_config, kv_cache_config

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"MLA KV caches.*FLASHMLA"):
        _check_supported(*configs(mla))
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    _check_supported(*configs(full))  # a Llama-class model's cache passes
