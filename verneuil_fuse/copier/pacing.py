"""Pacing helpers for copiers: a token bucket and a bounded LRU of recent
uploads. Retries (`Backoff`, `retry`, `Stopped`) are the store's
(`verneuil_fuse.store.retry`), named here too for the copier's callers.

All are thread-safe: one copier shares them among its worker threads.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from verneuil_fuse.store.retry import Backoff, Stopped, retry

__all__ = ["DEFAULT_BURST", "DEFAULT_RATE", "Backoff", "RecentSet", "Stopped", "TokenBucket", "retry"]

# Verneuil's copier pacing: 30 requests per second, bursts of 100.
DEFAULT_RATE = 30.0
DEFAULT_BURST = 100


class TokenBucket:
    """At most `rate` acquisitions per second on average, `burst` at once.

    `rate` <= 0 (or None) disables pacing.  `acquire` sleeps on the optional
    stop event, so a stop request interrupts a long wait (raising Stopped).
    """

    def __init__(self, rate: Optional[float] = DEFAULT_RATE, burst: int = DEFAULT_BURST,
                 clock: Callable[[], float] = time.monotonic):
        self.rate = float(rate) if rate else 0.0
        self.burst = max(1, int(burst))
        self._clock = clock
        self._tokens = float(self.burst)
        self._stamp = clock()
        self._lock = threading.Lock()

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def try_acquire(self, n: float = 1.0) -> float:
        """Take `n` tokens if there are enough and return 0; else return how
        long to wait before they could be there (taking nothing)."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            self._refill(self._clock())
            if self._tokens >= n:
                self._tokens -= n
                return 0.0
            return (n - self._tokens) / self.rate

    def acquire(self, n: float = 1.0, stop: Optional[threading.Event] = None,
                deadline: Optional[float] = None) -> bool:
        """Wait for `n` tokens; False, without them, when they would come
        after `deadline` (a time.monotonic() value); Stopped on `stop`."""
        while True:
            wait = self.try_acquire(n)
            if wait <= 0:
                return True
            if deadline is not None and time.monotonic() + wait > deadline:
                return False
            if stop is not None:
                if stop.wait(wait):
                    raise Stopped()
            else:
                time.sleep(wait)


class RecentSet:
    """A bounded set of recently seen keys (LRU order), whose entries also
    expire after `max_age` seconds, so that a chunk the store has since lost
    (lifecycle expiry) is not skipped forever."""

    def __init__(self, capacity: int = 1 << 16, max_age: float = 6 * 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity = capacity
        self.max_age = max_age
        self._clock = clock
        self._items: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            stamp = self._items.get(key)
            if stamp is None:
                return False
            if self._clock() - stamp > self.max_age:
                del self._items[key]
                return False
            self._items.move_to_end(key)
            return True

    def add(self, key: str) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[key] = self._clock()
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
