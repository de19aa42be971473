"""Retries of store requests: one backoff schedule and one loop for every
caller (the copier's uploads, the reader's chunk GETs, the S3 engine's
synchronous requests).

- `Backoff`: how long to wait before each retry (exponential, capped, with
  "full jitter" by default) and how many attempts in all.
- `retry`: the loop for a blocking call, bounded by the attempts and an
  optional deadline, interruptible by a stop event.
- `retried`: `retry` with the defaults, for a one-off command's request;
- `retry_async`: the same loop for a coroutine; the caller passes its event
  loop's sleep and bounds it by its own deadline (a cancel scope).

Which errors are worth another attempt is the caller's to say (``transient``:
exception types, or a predicate); `TRANSIENT`, the default, is the usual
answer for a store request: `TransientError` (throttled, 5xx, the network).
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, TypeVar, Union

from verneuil_fuse.store.base import TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

# The first retry waits about this long (50 ms): a throttled or briefly
# failing store usually answers again within tens of milliseconds.
DEFAULT_BASE = 0.05
# No wait exceeds 2 s: a longer pause only adds latency once the store is
# back, and the callers' deadlines bound the whole anyway.
DEFAULT_CAP = 2.0
# Six attempts in all: with the defaults, about 3 s of waiting at most
# before the error is the caller's.
DEFAULT_ATTEMPTS = 6

# The errors worth another attempt for a store request.
TRANSIENT: tuple[type[BaseException], ...] = (TransientError,)

Retryable = Union[tuple, Callable[[BaseException], bool]]


class Stopped(Exception):
    """A stop was asked while waiting (for a retry, or a copier's token)."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: before retry k (1 for the first) the wait is
    bounded by ``min(cap, base * 2**k)``; with ``jitter`` ("full jitter")
    it is a uniform random time below that bound, so callers that failed
    together do not retry together; without, it is the jittered wait's
    mean (half the bound), never more than ``cap``. ``attempts``: how many
    in all, the first included."""

    base: float = DEFAULT_BASE
    cap: float = DEFAULT_CAP
    attempts: int = DEFAULT_ATTEMPTS
    jitter: bool = True

    def delay(self, retry: int) -> float:
        """The wait before retry number ``retry`` (1 for the first)."""
        if self.jitter:
            return random.uniform(0, min(self.cap, self.base * (2 ** retry)))
        return min(self.cap, self.base * (2 ** (retry - 1)))


def is_retryable(error: BaseException, retryable: Retryable) -> bool:
    if isinstance(retryable, tuple):
        return isinstance(error, retryable)
    return retryable(error)


def retry(fn: Callable[[], T], *, backoff: Backoff, transient: Retryable = TRANSIENT,
          stop: Optional[threading.Event] = None, what: str = "request",
          deadline: Optional[float] = None) -> T:
    """Call ``fn``; on a ``transient`` exception, call it again, up to
    ``backoff.attempts`` times in all, waiting `Backoff.delay` in between.
    The last failure propagates, also as soon as the next attempt would
    start after ``deadline`` (a time.monotonic() value); any other exception
    at once. A stop request ends the wait by raising `Stopped`."""
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_retryable(e, transient):
                raise
            attempt += 1
            if attempt >= backoff.attempts:
                raise
            delay = backoff.delay(attempt)
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            log.debug("%s failed (%s); retry %d in %.3fs", what, e, attempt, delay)
            if stop is not None:
                if stop.wait(delay):
                    raise Stopped() from e
            else:
                time.sleep(delay)


def retried(fn: Callable[[], T], what: str) -> T:
    """One store request, retried while transient on the default schedule
    (`Backoff()`): what a one-off command (repair, convert) makes."""
    return retry(fn, backoff=Backoff(), what=what)


async def retry_async(fn: Callable[[], Awaitable[T]], *, backoff: Backoff, sleep: Callable[[float], Awaitable],
                      transient: Retryable = TRANSIENT, failed: int = 0) -> T:
    """`retry` for a coroutine function: ``await fn()`` up to
    ``backoff.attempts`` times, ``await sleep(delay)`` in between (the event
    loop's sleep, so that a cancellation ends the wait). ``failed``: the
    attempts already made, and failed, elsewhere (fewer than
    ``backoff.attempts``): the loop starts with the wait before the next.
    The caller bounds the whole with its own deadline (a cancel scope) and
    counts or logs each failure in ``fn``."""
    attempt = failed
    while True:
        if attempt:
            await sleep(backoff.delay(attempt))
        try:
            return await fn()
        except Exception as e:
            attempt += 1
            if attempt >= backoff.attempts or not is_retryable(e, transient):
                raise
