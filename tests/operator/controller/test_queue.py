"""The work queue: a key at most once, never processed twice at once, retries through the same queue."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.operator.controller.queue import WorkQueue

CHAT, CODE = ("ml", "chat"), ("ml", "code")


def run(coroutine: object) -> object:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


def test_a_burst_of_adds_is_one_key_in_order_of_first_add() -> None:
    async def burst() -> list[tuple[str, str]]:
        queue = WorkQueue()
        for key in (CHAT, CODE, CHAT, CHAT, CODE):
            queue.add(key)
        assert queue.pending() == 2
        return [await queue.get(), await queue.get()]

    assert run(burst()) == [CHAT, CODE]


def test_an_add_while_the_key_is_processed_queues_it_once_more_when_done() -> None:
    async def during() -> None:
        queue = WorkQueue()
        queue.add(CHAT)
        assert await queue.get() == CHAT
        # Events while it is reconciled: not a second worker on it, one more reconcile afterwards.
        queue.add(CHAT)
        queue.add(CHAT)
        assert queue.pending() == 0
        queue.done(CHAT)
        assert queue.pending() == 1 and await queue.get() == CHAT
        queue.done(CHAT)
        assert queue.pending() == 0

    run(during())


def test_add_after_keeps_the_earliest_and_adds_when_due() -> None:
    async def later() -> None:
        queue = WorkQueue()
        queue.add_after(CHAT, 60)
        queue.add_after(CHAT, 0.05)
        queue.add_after(CHAT, 30)  # later than the pending one: nothing changes
        assert queue.later(CHAT) == pytest.approx(0.05, abs=0.04) and queue.pending() == 0
        assert await asyncio.wait_for(queue.get(), 2) == CHAT
        assert queue.later(CHAT) is None

    run(later())


def test_failures_back_off_doubling_to_the_cap_and_forget_resets() -> None:
    async def backoff() -> list[float]:
        queue = WorkQueue(first_retry_seconds=1, last_retry_seconds=5)
        delays = [queue.add_rate_limited(CHAT) for _ in range(5)]
        assert queue.add_rate_limited(CODE) == 1  # per key
        queue.forget(CHAT)
        delays.append(queue.add_rate_limited(CHAT))
        return delays

    assert run(backoff()) == [1, 2, 4, 5, 5, 1]
