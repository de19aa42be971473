"""The fetcher's GETs of chunks from the store: one chunk's download with
attempts of at most ``timeout`` seconds, jittered backoff between them
(`store.retry`), a deadline for the whole fetch, each attempt on the chunk
engine or in a worker thread (`store.Reads.chunk`: bounded and verified),
counted; then `FetchError`. A give-up for want of an answer marks the store
unreachable (logged once, in the stats) until the next GET that succeeds.

Tested by tests/test_reader_fetcher.py (test_retries_then_success_and_timeouts,
test_corrupt_or_missing_chunk_is_an_error_never_bytes), tests/test_faults.py
and tests/test_mount_credentials.py.
"""
from __future__ import annotations

import logging
import time

import trio

from verneuil_fuse.format import ChunkError, ChunkSource, Fprint
from verneuil_fuse.reader.flights import Flight
from verneuil_fuse.reader.throttle import is_congestion
from verneuil_fuse.store import NotFound, StoreError, TooLarge
from verneuil_fuse.store.retry import Backoff, retry_async

log = logging.getLogger(__name__)

# The longest wait between two attempts of a GET, whatever the fetcher's
# ``backoff`` (`fetcher.DEFAULT_BACKOFF`) and the attempts made: a store
# back from a hiccup is asked again within 2 s.
BACKOFF_CAP = 2.0
# What one GET attempt may fail with (`StoreGets._get_once`).
_GET_FAILURES = (ChunkError, StoreError, OSError)


def _worth_retrying(error: BaseException) -> bool:
    """A failed GET worth another attempt: the transport, a store's answer
    (a 404 included: a chunk listed by a manifest just written may be on its
    way), a blob that failed verification; not an object over its size
    bound, which is the same object next time."""
    return isinstance(error, _GET_FAILURES) and not isinstance(error, TooLarge)


class FetchError(Exception):
    """A chunk could not be obtained (after retries, or before the deadline):
    the read must fail."""


class StoreGets:
    """The store side of `fetcher.Fetcher`'s flights (see the module's
    docstring): GETs with retries and a deadline, and the store's health."""

    def _init_health(self) -> None:
        # Chunks given up on: fingerprint -> (trio time, the error).
        self._failed: dict[Fprint, tuple[float, FetchError]] = {}
        # Whether the store answers: False from a give-up for want of an
        # answer until the next GET that succeeds.
        self.reachable = True
        self.unreachable_since = 0.0  # time.time()
        self.last_store_error: str | None = None

    def _retry_schedule(self) -> Backoff:
        """The waits between a GET's attempts (`store.retry`)."""
        return Backoff(base=self.backoff, cap=BACKOFF_CAP, attempts=self.retries + 1)

    async def _download(self, fp: Fprint, flight: Flight, *, failed: int = 0,
                        last: BaseException | None = None) -> bytes:
        """GET and verify one chunk: attempts of at most ``timeout`` seconds,
        with backoff, until one succeeds, ``retries`` retries are spent or
        ``deadline`` seconds have passed (queueing for a GET slot included);
        then FetchError. ``failed``: attempts already made on the engine path
        (whose deadline started then), ``last`` the error of the last."""
        name = fp.name
        source = flight.source if flight.source is not None else ChunkSource(name)
        if not failed:
            flight.deadline = trio.current_time() + self.deadline
        attempts = failed

        async def attempt() -> bytes:
            nonlocal attempts, last
            attempts += 1
            try:
                return await self._get_once(fp, name, attempts, source)
            except _GET_FAILURES as e:
                last = e
                raise

        async def sleep(delay: float) -> None:
            self.stats["retries"] += 1
            if last is not None and is_congestion(last):
                try:
                    await self.limit.hold(delay)  # a throttled GET's wait takes a GET's place
                finally:
                    self._engine.pump()  # the place given back may let a queued flight go
            else:
                await trio.sleep(delay)

        with trio.move_on_at(flight.deadline) as deadline:
            try:
                return await retry_async(attempt, backoff=self._retry_schedule(), sleep=sleep,
                                         transient=_worth_retrying, failed=failed)
            except _GET_FAILURES:
                pass
        if deadline.cancelled_caught:
            last = TimeoutError("no answer from the store within the %.0fs deadline (last: %s)"
                                % (self.deadline, last or "none"))
        raise self._gave_up(name, attempts, last)

    async def _get_once(self, fp: Fprint, name: str, attempt: int, source: ChunkSource) -> bytes:
        """One attempt of `_download`, counted: on the chunk engine if there
        is an engine path and ``source`` is a whole chunk object (its request
        has ``timeout`` as its own bound), else in a worker thread abandoned
        after ``timeout``. Raises one of `_GET_FAILURES` (a timeout as
        TimeoutError)."""
        start = time.monotonic()
        try:
            try:  # a free one costs no trip through the scheduler
                self.io_limiter.acquire_nowait()
            except trio.WouldBlock:
                await self.io_limiter.acquire()
            try:
                self.stats["gets"] += 1
                answer = None if source.ranged else await self._engine.get_one(fp)
                if answer is None:
                    with trio.fail_after(self.timeout):
                        answer = await trio.to_thread.run_sync(self.reads.chunk, source, fp,
                                                               abandon_on_cancel=True, limiter=self.thread_limiter)
            finally:
                self.io_limiter.release()
                self._engine.pump()  # flights queued for the engine may go now
        except trio.TooSlowError:
            error: BaseException = TimeoutError("GET %s timed out after %.1fs" % (name, self.timeout))
        except _GET_FAILURES as e:
            error = e
        else:
            size, data = answer
            self.limit.answered(None)
            self.stats["get_bytes"] += size
            log.debug("GET %s: %d bytes in %.3fs", name, size, time.monotonic() - start)
            self._store_answered()
            return data
        self.limit.answered(error)
        self._count_get_error(name, error, attempt, time.monotonic() - start)
        raise error

    def _count_get_error(self, name: str, error: BaseException, attempt: int, took: float) -> None:
        """Count (and log at debug level) one failed GET attempt."""
        if isinstance(error, ChunkError):
            self.stats["corrupt"] += 1
        elif isinstance(error, TooLarge):
            self.stats["too_large"] += 1
        self.stats["get_errors"] += 1
        if not isinstance(error, TooLarge):
            log.debug("GET %s failed (attempt %d, %.3fs): %s", name, attempt, took, error)

    def _gave_up(self, name: str, attempts: int, last: BaseException | None) -> FetchError:
        """Count and log the failure of a chunk's fetch: the FetchError to
        raise. A failure for want of an answer marks the store unreachable."""
        self.stats["failed"] += 1
        if isinstance(last, (TimeoutError, OSError)) or (
            isinstance(last, StoreError) and not isinstance(last, (NotFound, TooLarge))
        ):
            self._store_unanswered(last)
        log.error("giving up on chunk %s after %d attempts: %s", name, attempts, last)
        text = str(last)
        return FetchError(text if name in text else "chunk %s: %s" % (name, text))

    def _store_answered(self) -> None:
        if not self.reachable:
            self.reachable = True
            self._failed.clear()  # given up on while the store failed: worth a new try
            log.warning("the store answers again (unreachable for %.0fs)", time.time() - self.unreachable_since)

    def _store_unanswered(self, error: BaseException) -> None:
        self.last_store_error = str(error)
        if self.reachable:
            self.reachable = False
            self.unreachable_since = time.time()
            log.warning("the store is unreachable or failing (%s): reads that need it fail with a remote "
                        "I/O error within %.0fs (mount option deadline)", error, self.deadline)
