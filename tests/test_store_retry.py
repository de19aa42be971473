"""The shared retry module (verneuil_fuse/store/retry.py): schedule, bounds,
which errors are retried, the blocking and the async loop."""
from __future__ import annotations

import threading
import time

import pytest
import trio

from verneuil_fuse.store import NotFound, TransientError
from verneuil_fuse.store.retry import Backoff, Stopped, retry, retry_async


def failing(errors: list, result="ok"):
    """A call that raises ``errors`` in turn, then returns ``result``;
    ``calls`` counts its calls."""
    calls = []

    def call():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return result

    return call, calls


def test_backoff_schedule():
    plain = Backoff(base=0.05, cap=2.0, attempts=5, jitter=False)
    assert [plain.delay(k) for k in range(1, 8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0]
    jittered = Backoff(base=0.05, cap=2.0)
    for k in range(1, 10):
        waits = [jittered.delay(k) for _ in range(200)]
        bound = min(2.0, 0.05 * 2 ** k)
        assert all(0 <= w <= bound for w in waits)
        assert len(set(waits)) > 100  # random, so callers that failed together spread out
    assert Backoff().attempts == 6


def test_retry_transient_until_success_or_attempts_spent():
    call, calls = failing([TransientError("503"), TransientError("503")])
    assert retry(call, backoff=Backoff(0.001, 0.01, 3)) == "ok" and len(calls) == 3
    call, calls = failing([TransientError("503")] * 3)
    with pytest.raises(TransientError):
        retry(call, backoff=Backoff(0.001, 0.01, 3))
    assert len(calls) == 3


def test_retry_other_errors_propagate_at_once():
    call, calls = failing([NotFound("gone")])
    with pytest.raises(NotFound):
        retry(call, backoff=Backoff(0.001, 0.01, 5))
    assert len(calls) == 1
    # ... unless the caller says they are worth it: types or a predicate.
    call, calls = failing([NotFound("gone"), ValueError("x")])
    with pytest.raises(ValueError):
        retry(call, backoff=Backoff(0.001, 0.01, 5), transient=(NotFound,))
    assert len(calls) == 2
    call, calls = failing([KeyError("a"), KeyError("b")])
    assert retry(call, backoff=Backoff(0.001, 0.01, 5), transient=lambda e: isinstance(e, KeyError)) == "ok"


def test_retry_deadline_and_stop():
    # A retry that would start after the deadline is not waited for.
    call, calls = failing([TransientError("x")] * 10)
    start = time.monotonic()
    with pytest.raises(TransientError):
        retry(call, backoff=Backoff(1.0, 1.0, 10, jitter=False), deadline=time.monotonic() + 0.5)
    assert len(calls) == 1 and time.monotonic() - start < 0.5
    # A stop request ends the wait.
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    call, calls = failing([TransientError("x")] * 10)
    start = time.monotonic()
    with pytest.raises(Stopped):
        retry(call, backoff=Backoff(5.0, 5.0, 10, jitter=False), stop=stop)
    assert time.monotonic() - start < 2


def test_retry_async():
    slept: list[float] = []

    async def sleep(delay):
        slept.append(delay)
        await trio.sleep(0)

    async def go():
        errors = [TransientError("a"), TransientError("b")]
        calls = []

        async def call():
            calls.append(1)
            if errors:
                raise errors.pop(0)
            return 7

        assert await retry_async(call, backoff=Backoff(0.01, 1.0, 5, jitter=False), sleep=sleep) == 7
        assert len(calls) == 3 and slept == [0.01, 0.02]
        # Not transient: no retry. Attempts spent: the last error.
        errors[:] = [NotFound("x")]
        with pytest.raises(NotFound):
            await retry_async(call, backoff=Backoff(0.01, 1.0, 5), sleep=sleep)
        errors[:] = [TransientError("c")] * 3
        with pytest.raises(TransientError):
            await retry_async(call, backoff=Backoff(0.0, 0.0, 2), sleep=sleep)
        assert len(errors) == 1  # two attempts in all
        # Resumed after a first attempt made elsewhere: the wait before the
        # second attempt first, then the rest of the schedule.
        slept.clear()
        errors[:] = [TransientError("e")]
        assert await retry_async(call, backoff=Backoff(0.01, 1.0, 5, jitter=False), sleep=sleep, failed=1) == 7
        assert slept == [0.01, 0.02]
        # The caller's deadline ends a wait.
        errors[:] = [TransientError("d")] * 3
        with trio.move_on_after(0.1) as scope:
            await retry_async(call, backoff=Backoff(10.0, 10.0, 3, jitter=False), sleep=trio.sleep)
        assert scope.cancelled_caught

    trio.run(go)
