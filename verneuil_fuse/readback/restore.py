"""Read a replica back out of a store: rebuild the database file a
manifest describes from its chunks, every one verified, in either layout (a
chunk object per GET, or runs of adjacent chunks of a pack per range GET),
through the store's one verified read (`store.Reads`).

Used by `verneuilctl restore` and by the tests that check copiers end to
end. A wrong byte is never written: chunks are checked against their full
128-bit fingerprints, and files are published by rename only once complete.
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import BinaryIO, Callable, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.pool import DaemonPool
from verneuil_fuse.store import ReadError, Reads, Store

# What to tell a user whose database is past the size bound it is read with.
RAISE_LIMIT_HINT = "raise max_db_size (verneuilctl --max-db-size) if that database is genuine"


def fetch_manifest(store: Store, name: str, version_id: Optional[str] = None, *,
                   max_db_size: int = fmt.DEFAULT_MAX_DB_SIZE) -> fmt.Manifest:
    """Manifest `name` (or that version of it), read and decoded within
    `max_db_size`; a failure is one ReadError line."""
    return Reads(store, max_db_size=max_db_size, hint=RAISE_LIMIT_HINT).load(name, version_id)


def _window_runs(m: fmt.Manifest, indexes: range) -> list[fmt.Run]:
    """The reads that fetch the chunks of `indexes` that need one: not
    bundled, not the zero chunk, each fingerprint once."""
    wanted: dict[fmt.Fprint, int] = {}
    for i in indexes:
        fp = m.chunks[i]
        if i not in m.bundled and fp != fmt.ZERO_CHUNK_FPRINT:
            wanted.setdefault(fp, i)
    return fmt.chunk_runs(m, sorted(wanted.values()))


def _chunk_bytes(m: fmt.Manifest, i: int, got: dict[fmt.Fprint, bytes]) -> bytes:
    """Chunk `i`'s bytes, checked against the length the manifest gives it."""
    fp = m.chunks[i]
    want = m.chunk_length(i)
    if i in m.bundled:
        data = m.bundled[i]
    elif fp == fmt.ZERO_CHUNK_FPRINT:
        data = bytes(want)
    else:
        data = got[fp]
    if len(data) != want:
        raise ReadError("chunk %d (%s) has %d bytes, the manifest says %d" % (i, fp.name, len(data), want))
    return data


def write_snapshot(store: Store, m: fmt.Manifest, out: BinaryIO, *, workers: int = 8,
                   window: int = 256, progress: Optional[Callable[[int, int], None]] = None) -> int:
    """Write the file `m` describes to `out`, in order, `window` chunks at a
    time, their reads (a chunk object each, or runs of a pack) in parallel;
    returns the number of bytes written. A chunk missing or that does not
    verify is one ReadError line."""
    reads = Reads(store)

    def fetch(run: fmt.Run) -> list[tuple[int, bytes]]:
        return reads.load_run(run, {i: m.chunks[i] for i, _, _ in run.parts})

    pool = DaemonPool(workers, name="restore")
    written = 0
    try:
        n = len(m.chunks)
        for start in range(0, n, window):
            indexes = range(start, min(n, start + window))
            got: dict[fmt.Fprint, bytes] = {}
            for ok, value in pool.map(fetch, _window_runs(m, indexes)):
                if not ok:
                    raise value
                got.update((m.chunks[i], data) for i, data in value)
            for i in indexes:
                data = _chunk_bytes(m, i, got)
                out.write(data)
                written += len(data)
            if progress is not None:
                progress(written, m.len)
    finally:
        pool.close()
    return written


def restore_to_path(store: Store, m: fmt.Manifest, path: str, **kw) -> int:
    """Write the snapshot to `path` atomically: a temporary file in the same
    directory, fsynced, then renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(path), suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            n = write_snapshot(store, m, f, **kw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644 & ~_umask())
        os.rename(tmp, path)
        return n
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


_umask_lock = threading.Lock()


def _umask() -> int:
    with _umask_lock:
        mask = os.umask(0)
        os.umask(mask)
    return mask


def restore_bytes(store: Store, m: fmt.Manifest) -> bytes:
    import io
    buf = io.BytesIO()
    write_snapshot(store, m, buf)
    return buf.getvalue()
