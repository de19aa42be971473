"""Read a replica back out of a store: fetch and validate a manifest, then
rebuild the database file from its chunks, every one verified.

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
from ..store import NotFound, TooLarge
from .pool import DaemonPool


class RestoreError(Exception):
    """A replica that cannot be restored (missing or corrupt); one line."""


# What to tell a user whose manifest is over the size limit.
RAISE_LIMIT_HINT = "raise max_db_size (verneuilctl --max-db-size) if that database is genuine"


def chunk_fetcher(store) -> Callable[[fmt.Fprint], bytes]:
    """fetch(fprint) -> the chunk's verified bytes.  A chunk object larger
    than `fmt.MAX_CHUNK_BLOB_BYTES` is refused unread (RestoreError)."""
    def fetch(fp: fmt.Fprint) -> bytes:
        if fp == fmt.ZERO_CHUNK_FPRINT:
            return bytes(fmt.CHUNK_SIZE)
        try:
            blob = store.chunks.get(fp.name, max_bytes=fmt.MAX_CHUNK_BLOB_BYTES)
        except NotFound:
            raise RestoreError("chunk %s is missing from the store" % fp.name) from None
        except TooLarge as e:
            raise RestoreError("corrupt chunk in the store: %s is %s, more than the %d bytes "
                               "a chunk object may hold"
                               % (fp.name, "%d bytes" % e.size if e.size is not None
                                  else "larger", fmt.MAX_CHUNK_BLOB_BYTES)) from None
        try:
            return fmt.decode_chunk(blob, fp)
        except fmt.ChunkError as e:
            raise RestoreError("corrupt chunk in the store: %s" % e) from None
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


def write_snapshot(store, m: fmt.Manifest, out: BinaryIO, *, workers: int = 8,
                   window: int = 64, progress: Optional[Callable[[int, int], None]] = None) -> int:
    """Write the file `m` describes to `out`, in order, fetching chunks in
    parallel; returns the number of bytes written."""
    fetch = chunk_fetcher(store)
    pool = DaemonPool(workers, name="restore")
    written = 0
    try:
        n = len(m.chunks)
        for start in range(0, n, window):
            indexes = range(start, min(n, start + window))

            def get(i: int) -> bytes:
                if i in m.bundled:
                    return m.bundled[i]
                return fetch(m.chunks[i])

            for i, (ok, value) in zip(indexes, pool.map(get, indexes)):
                if not ok:
                    raise value
                data = value
                want = m.chunk_length(i)
                if len(data) < want and m.chunks[i] == fmt.ZERO_CHUNK_FPRINT:
                    data = bytes(want)
                if len(data) != want:
                    raise RestoreError("chunk %d (%s) has %d bytes, the manifest says %d"
                                       % (i, m.chunks[i].name, len(data), want))
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
