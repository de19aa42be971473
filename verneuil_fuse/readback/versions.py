"""The versions of a database in the store, read for `verneuilctl versions`
and `restore --at`: each version's manifest read and decoded through the
store's one verified read (`store.Reads`), its time
(`history.version_time_ns`), its chunks checked for presence, and the
version current at a given time found by `history.newest_at` (back from
the newest version). Blocking: worker threads from `pool.DaemonPool`."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.history import NS, format_time, newest_at, version_time_ns
from verneuil_fuse.pool import DaemonPool
from verneuil_fuse.readback.repair import find_missing
from verneuil_fuse.store import ReadError, Reads, Store

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Version:
    """One version of a database's manifest, read (or not) from the store."""

    info: Any  # store.VersionInfo
    time_ns: int
    time_source: str  # "manifest" or "store"
    manifest: Any = None  # format.Manifest, None when unreadable
    error: Optional[str] = None
    missing_chunks: Optional[int] = None  # None: not checked

    def describe(self) -> dict:
        m = self.manifest
        out = {"version_id": self.info.version_id, "time": format_time(self.time_ns),
               "time_ns": self.time_ns, "time_source": self.time_source,
               "store_time": format_time(int(self.info.mtime * NS)), "blob_size": self.info.size,
               "is_latest": self.info.is_latest, "size": m.len if m is not None else None,
               "chunks": len(m.chunks) if m is not None else None,
               "missing_chunks": self.missing_chunks,
               "complete": None if self.missing_chunks is None and self.error is None
               else (self.error is None and self.missing_chunks == 0)}
        if self.error is not None:
            out["error"] = self.error
        return out


def load_version(reads: Reads, key: str, info) -> Version:
    """The version `info` of manifest `key`, decoded (base chunk fetched)
    when possible; an unreadable one gets the store's time and an error."""
    try:
        m = reads.load(key, info.version_id)
    except ReadError as e:
        t, source = version_time_ns(None, info.mtime)
        return Version(info, t, source, error=str(e))
    t, source = version_time_ns(m, info.mtime)
    return Version(info, t, source, manifest=m)


def load_all(reads: Reads, key: str, infos: list, *, workers: int) -> list[Version]:
    """Every version of `infos` read, `workers` at a time, in the same order."""
    pool = DaemonPool(max(1, workers), name="history")
    try:
        results = pool.map(lambda info: load_version(reads, key, info), infos)
    finally:
        pool.close()
    out = []
    for ok, value in results:
        if not ok:
            raise value
        out.append(value)
    return out


def _missing_in(m, missing: set) -> int:
    """How many chunk blobs `m` needs (distinct chunks, and its base chunk)
    sit in objects of `missing`."""
    lost: set = set()
    for key, indices in fmt.stored_objects(m).items():
        if key not in missing:
            continue
        if indices:
            lost.update(m.chunks[i] for i in indices)
        else:  # the base chunk
            lost.add(key)
    return len(lost)


def check_chunks(store: Store, versions: list[Version], *, workers: int) -> None:
    """Set `missing_chunks` of every readable version: one existence check
    per distinct object of them all (a chunk object, or a pack in the
    packed layout), `workers` at a time."""
    needed: dict = {}
    for v in versions:
        if v.manifest is not None:
            needed.update(dict.fromkeys(fmt.stored_objects(v.manifest)))
    pool = DaemonPool(max(1, workers), name="history-check")
    try:
        missing = set(find_missing(store, list(needed), pool))
    finally:
        pool.close()
    for v in versions:
        if v.manifest is not None:
            v.missing_chunks = _missing_in(v.manifest, missing)


def version_at(reads: Reads, key: str, at_ns: int) -> tuple[Optional[Version], list]:
    """(the version current at `at_ns` or None, every VersionInfo oldest
    first), reading the manifests of the versions from the newest back to
    the one chosen."""
    infos = reads.versions(key)
    loaded: dict[int, Version] = {}

    def time_of(index: int) -> int:
        if index not in loaded:
            loaded[index] = load_version(reads, key, infos[index])
        return loaded[index].time_ns

    index = newest_at(len(infos), at_ns, time_of)
    log.debug("%s at %s: version %s of %d (%d manifests read)", key, format_time(at_ns),
              index, len(infos), len(loaded))
    return (loaded[index] if index is not None else None), infos
