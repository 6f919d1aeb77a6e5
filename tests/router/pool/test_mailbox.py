"""A request's mailbox: a reader that keeps up reads every chunk as it came; one that is
behind reads what waits as one chunk, never across completions, finishes or failures."""

from __future__ import annotations

import asyncio

from engines.protocol import GenerateChunk, GenerateFailure
from router.pool.mailbox import DeltaMailbox


def _chunk(token: int, **fields: object) -> GenerateChunk:
    return GenerateChunk(token_ids=[token], text=f"<{token}>", **fields)  # type: ignore[arg-type]


def _read_all(mailbox: DeltaMailbox) -> list[object]:
    async def read() -> list[object]:
        return [await mailbox.get() for _ in range(len(mailbox))]

    return asyncio.run(read())


def test_a_reader_that_keeps_up_reads_each_chunk() -> None:
    async def run() -> list[list[int]]:
        mailbox, read = DeltaMailbox(), []
        for token in range(3):
            mailbox.put(_chunk(token))
            chunk = await mailbox.get()
            assert isinstance(chunk, GenerateChunk)
            read.append(chunk.token_ids)
        return read

    assert asyncio.run(run()) == [[0], [1], [2]]


def test_what_waits_unread_is_read_as_one_chunk() -> None:
    mailbox = DeltaMailbox()
    mailbox.put(_chunk(0, logprobs=[[(0, -0.1, 1, "a")]], num_cached_tokens=16))
    mailbox.put(_chunk(1, logprobs=[[(1, -0.2, 1, "b")]]))
    mailbox.put(_chunk(2, logprobs=[[(2, -0.3, 1, "c")]], finish_reason="stop", stop_reason=7))
    assert len(mailbox) == 1
    (joined,) = _read_all(mailbox)
    assert isinstance(joined, GenerateChunk)
    assert (joined.token_ids, joined.text) == ([0, 1, 2], "<0><1><2>")
    assert joined.logprobs is not None and [entry[0][0] for entry in joined.logprobs] == [0, 1, 2]
    assert (joined.finish_reason, joined.stop_reason, joined.num_cached_tokens) == ("stop", 7, 16)


def test_completions_finishes_and_failures_stay_apart() -> None:
    mailbox = DeltaMailbox()
    mailbox.put(_chunk(0, index=0))
    mailbox.put(_chunk(1, index=1))  # another of the request's n completions
    mailbox.put(_chunk(2, index=1, finish_reason="length"))  # joins its own completion
    mailbox.put(_chunk(3, index=1))  # after a finish: a chunk of its own
    mailbox.put(GenerateFailure("engine gone"))
    mailbox.put(_chunk(4, index=0))  # after a failure: a chunk of its own
    read = _read_all(mailbox)
    assert [getattr(item, "token_ids", None) for item in read] == [[0], [1, 2], [3], None, [4]]


def test_a_waiting_reader_wakes_for_the_first_delta() -> None:
    async def run() -> object:
        mailbox = DeltaMailbox()
        reader = asyncio.ensure_future(mailbox.get())
        await asyncio.sleep(0)
        assert not reader.done()
        mailbox.put(_chunk(9))
        return await asyncio.wait_for(reader, 5)

    chunk = asyncio.run(run())
    assert isinstance(chunk, GenerateChunk) and chunk.token_ids == [9]
