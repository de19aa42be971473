"""The follow loop: the manifests of the databases in use, checked every
``follow_interval`` seconds with a conditional read, so that a new version
reaches new opens and open connections within about that long of landing.

A check is `Backend.get_if_changed` with the tag (S3: the ETag) of the
manifest seen last: on S3 a GET with If-None-Match, answered 304 with no
body while the manifest is unchanged; on a directory store a stat. A
changed manifest goes through the catalog's install path (`Catalog.offer`),
as a poll's would: a new `Replica`, the entry invalidated, the followers
moved (`follow.py`). The first check of a database reads its manifest
whole (no tag yet).

In use (`Catalog.in_use`): a database with an open handle, or opened in the
last `RECENT_SECONDS`; at most `MAX_PER_PASS` per pass, open ones first.
Every other database waits for the catalog's poll (``refresh=``, a listing
of the manifest bucket). The cost is one request per database in use per
interval (docs/READER.md, "Following: what it costs").
"""
from __future__ import annotations

import logging
from typing import Any

import trio

from verneuil_fuse.reader.catalog import Catalog
from verneuil_fuse.reader.fetcher import FetchError
from verneuil_fuse.reader.tree import DbEntry
from verneuil_fuse.store import NotFound, StoreError

log = logging.getLogger(__name__)

# The default ``follow_interval``: a new version reaches readers within
# about half a second of its manifest landing (the issue asks for a
# second), for 2 requests a second per database in use (a 304 on S3).
DEFAULT_INTERVAL = 0.5
# A database opened this long ago, and closed since, is still checked: a
# program that opens a database for each query or request keeps it
# fresh; one opened once a minute gets the poll's freshness.
RECENT_SECONDS = 60.0
# Checks per pass, at most: 64 requests every half second is 128 a second
# (4 threads at 30 ms each, `fetcher.CHECK_THREADS`); past this many
# databases in use, the most recently opened ones wait for the poll.
MAX_PER_PASS = 64
# Shortest pause between two passes, as a share of the interval, when a
# pass took longer than the interval (a slow store): the loop never spins.
MIN_PAUSE_SHARE = 0.2
# Manifest tags kept: those of the databases in use, and at most this many.
MAX_TAGS = 4 * MAX_PER_PASS


class Watch:
    """The follow loop of one mount (see the module docstring)."""

    def __init__(self, catalog: Catalog, interval: float = DEFAULT_INTERVAL):
        self.catalog = catalog
        self.fetcher = catalog.fetcher
        self.interval = interval
        self.watched = 0
        self.counts = dict.fromkeys(("passes", "checks", "not_modified", "bodies", "new_versions", "errors"), 0)
        self._tags: dict[str, str] = {}
        self._failing = False

    async def run(self) -> None:
        """Check every ``interval`` seconds, forever (0: never)."""
        if self.interval <= 0:
            return
        while True:
            start = trio.current_time()
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - keep following what we can
                self.counts["errors"] += 1
                log.exception("follow loop: pass failed")
            elapsed = trio.current_time() - start
            await trio.sleep(max(self.interval - elapsed, self.interval * MIN_PAUSE_SHARE))

    async def check_once(self) -> None:
        """One pass over the databases in use."""
        self.counts["passes"] += 1
        entries = self.catalog.in_use(RECENT_SECONDS, MAX_PER_PASS)
        self.watched = len(entries)
        async with trio.open_nursery() as nursery:
            for entry in entries:
                nursery.start_soon(self._check, entry)
        if len(self._tags) > MAX_TAGS:
            keep = {e.key for e in entries}
            self._tags = {k: v for k, v in self._tags.items() if k in keep}

    async def _check(self, entry: DbEntry) -> None:
        key = entry.key
        self.counts["checks"] += 1
        # Known by name only (a listing changed it since it was read): its
        # manifest is read whole and offered, never loaded as a lookup
        # would (a blob that does not decode, e.g. damaged on the way, is
        # then only logged: the follow loop never takes a database out of
        # the tree).
        tag = self._tags.get(key) if entry.current is not None else None
        try:
            fetched_at = self.catalog.clock()
            tagged = await self.fetcher.get_manifest_if_changed(key, tag)
        except NotFound:
            self._tags.pop(key, None)  # gone from the store: the next poll removes it
            return
        except (StoreError, FetchError) as e:
            self.counts["errors"] += 1
            if not self._failing:
                log.warning("follow loop: cannot check %s: %s (the poll still runs)", key, e)
            self._failing = True
            return
        if self._failing:
            log.info("follow loop: the store answers again")
            self._failing = False
        if tagged is None:
            self.counts["not_modified"] += 1
            return
        self.counts["bodies"] += 1
        self._tags[key] = tagged.tag
        before = entry.current
        if await self.catalog.offer(entry, tagged.data, fetched_at) and entry.current is not before:
            self.counts["new_versions"] += 1

    def stats(self, followers: Any = None) -> dict[str, Any]:
        """The "follow" section of the stats: this loop's counters, the
        followers' (`Followers.stats`) and the catalog's lag histograms as
        a count and a sum (the metrics carry their buckets)."""
        out: dict[str, Any] = {"enabled": followers is not None, "interval": self.interval,
                               "watched": self.watched, **self.counts}
        if followers is not None:
            out.update(followers.stats())
        for event, h in self.catalog.lag.items():
            out["lag_%s_count" % event] = h.count
            out["lag_%s_sum_s" % event] = round(h.sum, 6)
        return out
