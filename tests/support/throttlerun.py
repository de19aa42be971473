"""A mount of moto's S3 through `FaultProxy` under a storm of SlowDown
answers: readers scan a replica over and over (no disk or memory cache, the
page cache dropped after each scan, so every scan GETs its chunks again),
first with the store answering everything, then with a share of the chunk
GETs answered 503 SlowDown for a while, then answering everything again.

`run_storm` returns the chunk GETs the proxy saw per second and what the
readers got (right bytes, EREMOTEIO, anything else: wrong). Used by
tests/test_mount_throttle.py (a short storm) and scripts/bench_throttle.py
(the 60 s storm of issue 36, with its figures).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time

from support.faultproxy import FaultProxy
from support.replicas import HOST, Mount, publish

# Bytes per read of the scanning readers: the kernel's largest FUSE request.
READ_BYTES = 1 << 20


@dataclasses.dataclass
class StormResult:
    before: float  # seconds of the phase before the storm
    storm: float
    after: float
    gets: list[int]  # chunk GETs the proxy saw in each second from the start
    refused: list[int]  # of which answered SlowDown
    right: int = 0  # scans read whole, every byte right
    remote_errors: int = 0  # scans that ended with EREMOTEIO
    wrong: list[str] = dataclasses.field(default_factory=list)  # anything else
    throttle_in_storm: dict = dataclasses.field(default_factory=dict)  # fetch.throttle at the storm's end
    throttle_after: dict = dataclasses.field(default_factory=dict)

    def rate(self, start: float, end: float) -> float:
        """Mean chunk GETs per second over whole seconds [start, end)."""
        seconds = self.gets[int(start):int(end)]
        return sum(seconds) / max(1, len(seconds))

    @property
    def unthrottled(self) -> float:
        """The rate before the storm, its first second (warming up) left out."""
        return self.rate(1, self.before)

    @property
    def in_storm(self) -> float:
        """The rate in the storm, its first second (the limit coming down) left out."""
        return self.rate(self.before + 1, self.before + self.storm)

    @property
    def peak_in_storm(self) -> int:
        return max(self.gets[int(self.before) + 1:int(self.before + self.storm)] or [0])

    def recovery(self, share: float = 0.5) -> float | None:
        """Seconds from the storm's end to the first whole second with at
        least ``share`` of the unthrottled rate; None if none."""
        end = int(self.before + self.storm)
        for second in range(end, len(self.gets)):
            if self.gets[second] >= share * self.unthrottled:
                return float(second + 1 - (self.before + self.storm))
        return None


def _scan(path: str, data: bytes, result: StormResult, lock: threading.Lock, stop: threading.Event) -> None:
    """Read the file whole, over and over, until ``stop``; count outcomes."""
    while not stop.is_set():
        fd = os.open(path, os.O_RDONLY)
        outcome = "right"
        try:
            offset = 0
            while offset < len(data):
                try:
                    got = os.pread(fd, READ_BYTES, offset)
                except OSError as e:
                    outcome = "remote" if e.errno == errno.EREMOTEIO else "errno %d" % e.errno
                    break
                if not got or got != data[offset:offset + len(got)]:
                    outcome = "wrong bytes at %d (%d read)" % (offset, len(got))
                    break
                offset += len(got)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next scan reads through the mount again
        finally:
            os.close(fd)
        with lock:
            if outcome == "right":
                result.right += 1
            elif outcome == "remote":
                result.remote_errors += 1
            else:
                result.wrong.append(outcome)


def run_storm(server, root: str, *, before: float = 3.0, storm: float = 6.0, after: float = 8.0,
              share: float = 0.8, readers: int = 4, size_mb: int = 8, options: str = "") -> StormResult:
    """The storm on a fresh mount under ``root`` (see the module docstring):
    ``share`` of the chunk GETs refused for ``storm`` seconds."""
    store = server.make_store()
    data = bytearray(os.urandom(size_mb << 20))
    data[:16] = b"SQLite format 3\x00"
    data = bytes(data)
    publish(store, data, "/data/scan.db", hostname=HOST)
    chunks = store.chunks.bucket
    proxy = FaultProxy(server.moto_endpoint)
    url = store.url.replace("endpoint=" + server.endpoint, "endpoint=" + proxy.endpoint)
    store.close()
    result = StormResult(before, storm, after, [], [])
    lock = threading.Lock()
    stop = threading.Event()
    mount = Mount(url, os.path.join(root, "mnt"),
                  "cache_size=0,mem_cache=0,refresh=3600,log_level=info,log_file=%s%s"
                  % (os.path.join(root, "storm.log"), "," + options if options else ""))
    threads = []
    try:
        with mount:
            path = mount.path("/%s/data/scan.db" % HOST)
            start = time.monotonic()
            threads = [threading.Thread(target=_scan, args=(path, data, result, lock, stop), daemon=True)
                       for _ in range(readers)]
            for t in threads:
                t.start()
            time.sleep(before)
            proxy.set_faults(share, ["slowdown"], seed=1,
                             match=lambda r: r.method == "GET" and r.bucket == chunks)
            time.sleep(storm)
            result.throttle_in_storm = mount.stats()["fetch"].get("throttle", {})
            proxy.clear()
            time.sleep(after)
            result.throttle_after = mount.stats()["fetch"].get("throttle", {})
            stop.set()
            for t in threads:
                t.join(60)
    finally:
        stop.set()
        proxy.close()
    total = int(before + storm + after) + 1
    result.gets = [0] * total
    result.refused = [0] * total
    for r in proxy.requests:
        second = int(r.time - start)
        if r.method == "GET" and r.bucket == chunks and 0 <= second < total:
            result.gets[second] += 1
            result.refused[second] += r.fault is not None
    return result
