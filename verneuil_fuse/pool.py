"""A tiny pool of daemon threads for parallel store requests (a copier's
uploads; restore's, versions' and repair's reads and checks), and `InFlight`,
a bound on requests under way on another thread.

concurrent.futures' pools join their (non-daemon) workers at interpreter
exit, which could hold up a writer process's exit behind a slow store; these
threads are daemons, so a copier running inside a writer never delays it.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_STOP = object()


class DaemonPool:
    def __init__(self, workers: int, name: str = "copier-worker"):
        self.workers = max(1, int(workers))
        self._name = name
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            for i in range(self.workers):
                t = threading.Thread(target=self._work, name="%s-%d" % (self._name, i), daemon=True)
                t.start()
                self._threads.append(t)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, arg, results, index, done = item
            try:
                results[index] = (True, fn(arg))
            except BaseException as e:  # handed back to the caller
                results[index] = (False, e)
            done.release()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[tuple[bool, object]]:
        """Run fn on every item; [(ok, result-or-exception)] in item order."""
        items = list(items)
        if not items:
            return []
        if self.workers == 1 or len(items) == 1:
            out = []
            for it in items:
                try:
                    out.append((True, fn(it)))
                except BaseException as e:
                    out.append((False, e))
            return out
        self._start()
        results: list = [None] * len(items)
        done = threading.Semaphore(0)
        for i, it in enumerate(items):
            self._queue.put((fn, it, results, i, done))
        for _ in items:
            done.acquire()
        return results

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(_STOP)


class InFlight:
    """Requests under way on an asynchronous transport (the store's HTTP
    engine), at most `limit` at once: `enter` waits for room, the request's
    completion calls `leave`, `drain` waits until none is left. Completions
    always come (the engine answers every request, with an error at its
    deadline or when it closes), so the waits end."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self._cond = threading.Condition()
        self._count = 0

    def enter(self) -> None:
        with self._cond:
            while self._count >= self.limit:
                self._cond.wait()
            self._count += 1

    def leave(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()

    def drain(self) -> None:
        with self._cond:
            while self._count:
                self._cond.wait()
