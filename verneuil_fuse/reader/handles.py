"""The catalog's open handles: which databases have a handle open, which
were opened recently (what the follow loop watches, `Handles.in_use`), and
the counts of opens per database and version.

Tested by tests/test_reader_follow.py and tests/test_mount_follow.py.
"""
from __future__ import annotations

import time

from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.tree import DbEntry


class Handles:
    """The open handles of `catalog.Catalog` (see the module's docstring)."""

    def opened(self, replica: Replica) -> None:
        replica.opens += 1
        self._opens_total[replica.key] = self._opens_total.get(replica.key, 0) + 1
        self._open_keys[replica.key] = self._open_keys.get(replica.key, 0) + 1
        self._last_opened[replica.key] = time.monotonic()
        if replica.inode in self._decoded:
            self._decoded.move_to_end(replica.inode)

    def released(self, replica: Replica) -> None:
        replica.opens -= 1
        left = self._open_keys.get(replica.key, 0) - 1
        if left > 0:
            self._open_keys[replica.key] = left
        else:
            self._open_keys.pop(replica.key, None)
        self._maybe_drop(replica)
        if replica.opens <= 0:
            self._trim()

    def in_use(self, recent: float, limit: int) -> list[DbEntry]:
        """At most ``limit`` databases of the tree, those with an open
        handle first, then those opened within the last ``recent`` seconds,
        the most recently opened first (past states excluded: their
        versions never change)."""
        now = time.monotonic()
        for key, at in list(self._last_opened.items()):
            if now - at > recent and key not in self._open_keys:
                del self._last_opened[key]
        keys = sorted(self._last_opened, key=lambda k: (k not in self._open_keys, -self._last_opened[k]))
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                out.append(entry)
                if len(out) >= limit:
                    break
        return out
