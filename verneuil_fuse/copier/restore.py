"""Read a replica back out of a store: fetch and validate a manifest, then
rebuild the database file from its chunks, every one verified, in either
layout (a chunk object per GET, or runs of adjacent chunks of a pack per
range GET: `format.chunk_runs`, `store.read_run`).

Used by `verneuilctl restore` / `manifest` / `ls` and by the tests that check
copiers end to end.  A wrong byte is never written: chunks are checked
against their full 128-bit fingerprints, and files are published by rename
only once complete.
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import BinaryIO, Callable, Optional

from .. import format as fmt
from ..store import NotFound, TooLarge, read_run
from .pool import DaemonPool


class RestoreError(Exception):
    """A replica that cannot be restored (missing or corrupt); one line."""


# What to tell a user whose manifest is over the size limit.
RAISE_LIMIT_HINT = "raise max_db_size (verneuilctl --max-db-size) if that database is genuine"


def _read_failure(run: fmt.Run, error: Exception) -> RestoreError:
    """The RestoreError of a run that could not be read (one line)."""
    what = "chunk %s" % run.key if run.end is None else "pack %s" % run.key
    if isinstance(error, NotFound):
        return RestoreError("%s is missing from the store" % what)
    if isinstance(error, TooLarge):
        return RestoreError("corrupt chunk in the store: %s is %s, more than the %d bytes "
                            "a chunk object may hold"
                            % (run.key, "%d bytes" % error.size if error.size is not None
                               else "larger", fmt.MAX_CHUNK_BLOB_BYTES))
    return RestoreError("corrupt chunk in the store: %s" % error)


def run_fetcher(store, m: fmt.Manifest) -> Callable[[fmt.Run], list[tuple[int, bytes]]]:
    """fetch(run) -> (index, verified bytes) of each chunk of a run of `m`
    (`fmt.chunk_runs`): one read of the store per run.  RestoreError for a
    run that is missing or does not verify."""
    def fetch(run: fmt.Run) -> list[tuple[int, bytes]]:
        try:
            return read_run(store.chunks, run, {i: m.chunks[i] for i, _, _ in run.parts})
        except (NotFound, TooLarge, fmt.ChunkError) as e:
            raise _read_failure(run, e) from None
    return fetch


def load_manifest_blob(store, name: str, version_id: Optional[str] = None, *,
                       max_db_size: int = fmt.DEFAULT_MAX_DB_SIZE) -> bytes:
    """The manifest object, refused unread (RestoreError) when it is larger
    than `fmt.manifest_blob_limit(max_db_size)`."""
    limit = fmt.manifest_blob_limit(max_db_size)
    try:
        if version_id is None:
            return store.manifests.get(name, max_bytes=limit)
        return store.manifests.get_version(name, version_id, max_bytes=limit)
    except NotFound:
        what = "manifest %s" % name if version_id is None else \
            "version %s of manifest %s" % (version_id, name)
        raise RestoreError("no such replicated database in %s: %s"
                           % (store.manifests.describe(), what)) from None
    except TooLarge as e:
        size = "%d bytes" % e.size if e.size is not None else "larger"
        raise RestoreError("manifest %s is %s, more than the %d-byte limit for databases of "
                           "up to %s (max_db_size); %s"
                           % (name, size, limit, fmt.format_size(max_db_size),
                              RAISE_LIMIT_HINT)) from None


def base_chunk_fetcher(store, max_db_size: int = fmt.DEFAULT_MAX_DB_SIZE) -> Callable[[fmt.Fprint], bytes]:
    """fetch(fprint) -> a base chunk's verified bytes: as long as the chunk
    list it encodes, up to `fmt.base_chunk_limit(max_db_size)`."""
    def fetch(fp: fmt.Fprint) -> bytes:
        limit = fmt.base_chunk_blob_limit(max_db_size)
        try:
            blob = store.chunks.get(fp.name, max_bytes=limit)
        except NotFound:
            raise RestoreError("base chunk %s is missing from the store" % fp.name) from None
        except TooLarge:
            raise RestoreError("base chunk %s is larger than the %d bytes a base chunk may hold for "
                               "databases of up to %s; %s" % (fp.name, limit, fmt.format_size(max_db_size),
                                                              RAISE_LIMIT_HINT)) from None
        try:
            return fmt.decode_base_chunk(blob, fp, max_db_size)
        except fmt.ChunkError as e:
            raise RestoreError("corrupt base chunk in the store: %s" % e) from None
    return fetch


def decode_manifest(blob: bytes, store=None, what: str = "manifest", *,
                    max_db_size: int = fmt.DEFAULT_MAX_DB_SIZE) -> fmt.Manifest:
    fetch = base_chunk_fetcher(store, max_db_size) if store is not None else None
    try:
        return fmt.decode_and_validate(blob, fetch_chunk=fetch, max_db_size=max_db_size)
    except fmt.ManifestError as e:
        if e.rule == "size-limit":
            raise RestoreError("%s is too large: %s; %s" % (what, e.detail, RAISE_LIMIT_HINT)) from None
        raise RestoreError("corrupt %s: %s" % (what, e)) from None


def fetch_manifest(store, name: str, version_id: Optional[str] = None, *,
                   max_db_size: int = fmt.DEFAULT_MAX_DB_SIZE) -> fmt.Manifest:
    return decode_manifest(load_manifest_blob(store, name, version_id, max_db_size=max_db_size),
                           store, "manifest %s" % name, max_db_size=max_db_size)


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
        raise RestoreError("chunk %d (%s) has %d bytes, the manifest says %d"
                           % (i, fp.name, len(data), want))
    return data


def write_snapshot(store, m: fmt.Manifest, out: BinaryIO, *, workers: int = 8,
                   window: int = 256, progress: Optional[Callable[[int, int], None]] = None) -> int:
    """Write the file `m` describes to `out`, in order, `window` chunks at a
    time, their reads (a chunk object each, or runs of a pack: `run_fetcher`)
    in parallel; returns the number of bytes written."""
    fetch = run_fetcher(store, m)
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


def restore_to_path(store, m: fmt.Manifest, path: str, **kw) -> int:
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


def restore_bytes(store, m: fmt.Manifest) -> bytes:
    import io
    buf = io.BytesIO()
    write_snapshot(store, m, buf)
    return buf.getvalue()
