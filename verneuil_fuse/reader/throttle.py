"""The mount's adaptive limit of chunk GETs in flight: `AdaptiveLimit`.

Every chunk GET of a mount (a chunk object, or a run of a pack's chunks in
one range GET) holds a slot of one `trio.CapacityLimiter` (the fetcher's
``io_limiter``), on the chunk engine's path and in tasks alike, first
attempts and retries alike. Its size follows the store, additive
increase, multiplicative decrease (as TCP does, and as S3's guidance asks
of clients it throttles: back off, lower the request rate):

- an answer that asks for fewer requests (503 SlowDown and kin:
  `store.Throttled`) or a GET that got no answer in time (`store.TimedOut`,
  a timeout) halves the limit, at most once per `DECREASE_INTERVAL` (the
  answers to the GETs of one round count once), down to `MIN_LIMIT`;
- each GET that succeeds adds one, up to the configured ``concurrency=``:
  a round of successes doubles the limit, so a store that stopped
  throttling gets the full rate back within a few round trips;
- while throttled (a throttling answer less than `QUIET_SECONDS` ago),
  prefetches are not started (`paused`): what the store gives goes to the
  reads that wait;
- a GET that was throttled waits before its retry (exponential backoff with
  full jitter, `store.retry`) holding a slot (`hold`), so the request rate
  under throttling is about the limit over the mean wait, not the limit
  over the time the store takes to say no.

`describe` gives the state for the stats: the limit, the bound, whether
throttled, the GETs answered per second over the last `RATE_WINDOW` seconds,
and the counts of throttling answers and decreases.
"""
from __future__ import annotations

import time
from collections import deque

import trio

from verneuil_fuse.store import Throttled, TimedOut

# The fewest GETs in flight the limit goes down to.
MIN_LIMIT = 1
# The limit halves at most once per this many seconds: a store that throttles
# answers a whole round of GETs at once, which is one signal, not 256 (S3
# answers in tens of milliseconds; 0.1 s takes about one round).
DECREASE_INTERVAL = 0.1
# Prefetches stay paused this long after the last throttling answer.
QUIET_SECONDS = 2.0
# The GETs-per-second figure of the stats is over this many seconds.
RATE_WINDOW = 5


def is_congestion(error: BaseException) -> bool:
    """A GET failure that means "fewer requests": throttled, or no answer
    in time."""
    return isinstance(error, (Throttled, TimedOut, TimeoutError))


class AdaptiveLimit:
    """The AIMD size of ``limiter`` (module docstring), between `MIN_LIMIT`
    and its size at creation."""

    def __init__(self, limiter: trio.CapacityLimiter, clock=time.monotonic):
        self.limiter = limiter
        self.ceiling = int(limiter.total_tokens)
        self._clock = clock
        self._last_decrease = -DECREASE_INTERVAL
        self._last_throttle = -QUIET_SECONDS
        self._window: deque[list[int]] = deque()  # [second, answers]
        self.throttles = 0  # throttling answers and timeouts
        self.decreases = 0

    @property
    def limit(self) -> int:
        return int(self.limiter.total_tokens)

    @property
    def paused(self) -> bool:
        """Whether prefetches wait (throttled a moment ago)."""
        return self._clock() - self._last_throttle < QUIET_SECONDS

    def answered(self, error: BaseException | None) -> None:
        """A GET ended: ``error`` None for a success."""
        now = self._clock()
        self._count(now)
        if error is None:
            if self.limit < self.ceiling:
                self.limiter.total_tokens = self.limit + 1
            return
        if not is_congestion(error):
            return
        self.throttles += 1
        self._last_throttle = now
        if now - self._last_decrease >= DECREASE_INTERVAL and self.limit > MIN_LIMIT:
            self._last_decrease = now
            self.decreases += 1
            self.limiter.total_tokens = max(MIN_LIMIT, self.limit // 2)

    async def hold(self, seconds: float) -> None:
        """Wait ``seconds`` (a throttled GET's backoff) holding a GET slot."""
        async with self.limiter:
            await trio.sleep(seconds)

    def _count(self, now: float) -> None:
        second = int(now)
        window = self._window
        if window and window[-1][0] == second:
            window[-1][1] += 1
        else:
            window.append([second, 1])
        while window[0][0] <= second - RATE_WINDOW:
            window.popleft()

    def describe(self) -> dict:
        now = int(self._clock())
        answers = sum(n for second, n in self._window if second > now - RATE_WINDOW)
        return {"limit": self.limit, "ceiling": self.ceiling, "throttled": self.paused,
                "gets_per_s": round(answers / RATE_WINDOW, 1), "throttles": self.throttles,
                "decreases": self.decreases}
