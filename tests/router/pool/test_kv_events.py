"""The exact prefix signal: vLLM's KV events named by the router's chained hashes on the
engine side (BlockNames), and the block set the router keeps from them (BlockIndex)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from engines.kv_events import BlockNames
from engines.protocol import CacheUpdate
from router.pool.engine_state import KV_EVENTS, MIRROR, EngineState
from router.pool.prefix_index import BlockIndex, PrefixHolders, PrefixIndex, PromptBlocks

BLOCK = 4
PROMPT = list(range(100, 113))  # three full blocks and one token


def _stored(
    hashes: list[bytes | int], parent: int | None, tokens: list[int], **extra: object
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **extra,  # type: ignore[arg-type]
    )


def _index_of(names: BlockNames, *events: object) -> BlockIndex:
    index = BlockIndex()
    for event in events:
        update = names.apply(event)
        if update is not None:
            index.apply(update)
    return index


def test_stored_blocks_are_found_by_the_routers_own_prompt_hashes() -> None:
    names = BlockNames()
    # vLLM stores the prompt's blocks in two events, the second chained to the first.
    index = _index_of(names, _stored([11, 12], None, PROMPT[:8]), _stored([13], 12, PROMPT[8:12]))
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 12
    assert index.cached_tokens(PromptBlocks(PROMPT[:12]), BLOCK) == 8  # the last token is computed
    assert index.cached_tokens(PromptBlocks([1, *PROMPT]), BLOCK) == 0  # another first block
    # The mirror, given the same prompt, agrees: one chain of hashes for both.
    mirror = PrefixIndex(BLOCK, 100)
    mirror.record(PromptBlocks(PROMPT))
    assert mirror.cached_tokens(PromptBlocks(PROMPT)) == 12


def test_an_evicted_block_ends_the_hit_where_the_mirror_sees_nothing() -> None:
    names = BlockNames()
    index = _index_of(names, _stored([11, 12, 13], None, PROMPT[:12]), BlockRemoved([12], "GPU"))
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 4


def test_cleared_and_unreachable_blocks_count_for_nothing() -> None:
    names = BlockNames()
    index = _index_of(names, _stored([11], None, PROMPT[:4]), AllBlocksCleared())
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 0
    # A child whose parent's store was never seen cannot be named, nor can salted blocks.
    orphan = _index_of(BlockNames(), _stored([12], 11, PROMPT[4:8]))
    assert len(orphan) == 0
    salted = _index_of(BlockNames(), _stored([11], None, PROMPT[:4], extra_keys=[("salt",)]))
    assert len(salted) == 0


def test_a_snapshot_replaces_the_index_and_repeated_changes_count_once() -> None:
    names = BlockNames()
    first = names.apply(_stored([11, 12], None, PROMPT[:8]))
    assert first is not None
    index = BlockIndex()
    index.apply(first)
    index.apply(first)  # crossed the snapshot: applied twice, held once
    index.apply(CacheUpdate(removed=[12]))
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 4
    index.apply(names.snapshot())  # the engine's own view, whole
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 8


def test_two_engine_blocks_of_one_content_stay_until_both_are_gone() -> None:
    names = BlockNames()
    index = _index_of(names, _stored([11], None, PROMPT[:4]), _stored([21], None, PROMPT[:4]))
    index.apply(CacheUpdate(removed=[11]))
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 4
    index.apply(CacheUpdate(removed=[21]))
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 0


def test_a_replica_routes_by_events_once_it_has_them_and_reports_both_signals() -> None:
    from engines.protocol import EngineStats

    state = EngineState()
    state.update_engine(
        EngineStats(replica="e", role="mixed", block_size=BLOCK, kv_capacity_blocks=100)
    )
    prompt = PromptBlocks(PROMPT)
    state.record_prompt(prompt)  # the mirror believes it is cached
    assert state.prefix_signal == MIRROR and state.cached_tokens(prompt) == 12
    state.apply_cache_update(CacheUpdate(cleared=True))  # the engine says: nothing held
    assert state.prefix_signal == KV_EVENTS
    assert state.cached_tokens_by_signal(prompt) == {MIRROR: 12, KV_EVENTS: 0}
    assert state.cached_tokens(prompt) == 0


def test_a_sent_prompt_counts_until_its_events_confirm_or_evict_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("router.pool.prefix_index.time.monotonic", lambda: clock[0])
    names = BlockNames()
    index = BlockIndex(pending_s=2.0)
    prompt = PromptBlocks(PROMPT)
    index.expect(prompt, BLOCK)  # sent, still prefilling: a second request would find it
    assert index.cached_tokens(prompt, BLOCK) == 12
    clock[0] += 2.5  # never confirmed (aborted before it ran): it lapses
    assert index.cached_tokens(prompt, BLOCK) == 0
    index.expect(prompt, BLOCK)
    stored = names.apply(_stored([11, 12, 13], None, PROMPT[:12]))
    assert stored is not None
    index.apply(stored)
    clock[0] += 10  # confirmed: held for as long as the engine holds it
    assert index.cached_tokens(prompt, BLOCK) == 12
    index.expect(prompt, BLOCK)  # sent again while held: nothing pending
    index.apply(CacheUpdate(removed=[12]))  # evicted: the hit ends there at once
    assert index.cached_tokens(prompt, BLOCK) == 4


def test_without_a_pending_time_only_events_count() -> None:
    index = BlockIndex()
    index.expect(PromptBlocks(PROMPT), BLOCK)
    assert index.cached_tokens(PromptBlocks(PROMPT), BLOCK) == 0


def test_holders_kept_late_learn_what_the_engine_held_and_was_sent_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool's inverse index starts with the first decision that reads it: it must
    then know every block held already, and the sent prompts still pending."""
    clock = [100.0]
    monkeypatch.setattr("router.pool.prefix_index.time.monotonic", lambda: clock[0])
    names = BlockNames()
    index = _index_of(names, _stored([11, 12], None, PROMPT[:8]))
    index._pending_s = 2.0
    other = PromptBlocks([7] * 12)
    index.expect(other, BLOCK)  # sent, not confirmed yet
    holders = PrefixHolders()
    index.keep_holders(holders, owner="e0")
    assert holders.deepest(PromptBlocks(PROMPT).hashes(BLOCK)) == (2, ["e0"])
    assert holders.deepest(other.hashes(BLOCK)) == (3, ["e0"])
    index.apply(CacheUpdate(removed=[12]))  # and from then on, every change
    assert holders.deepest(PromptBlocks(PROMPT).hashes(BLOCK)) == (1, ["e0"])
    clock[0] += 3  # the pending prompt lapsed
    assert holders.deepest(other.hashes(BLOCK)) == (0, [])
