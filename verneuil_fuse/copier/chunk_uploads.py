"""The copier's chunk uploads: each chunk file of a snapshot (or of
`staging/chunks`) read, checked against its name, compressed, put and
unlinked; a bad copy moved aside (its manifest is then not uploaded). Many
PUTs in flight on the store's HTTP engine when it has one and uploads are
unpaced (`put_async`), else paced and retried in the copier's threads; in
the packed layout, into packs (`packer.Packer`).

Tested by tests/test_copier_unit.py (test_staging_chunks_are_uploaded_before_manifest,
test_mismatched_chunk_blocks_its_manifest, test_recent_chunks_are_not_sent_again,
test_chunk_restaged_while_read_is_not_dead_lettered) and tests/test_copier_e2e.py.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.pacing import Stopped
from verneuil_fuse.pool import InFlight
from verneuil_fuse.store import StoreError


# Chunk PUTs one database's pass keeps in flight on the store's HTTP engine
# when uploads are unpaced: 64 answers per 20 ms round trip is ~200 MB/s of
# 64 KiB chunks, past what a plain multipart upload reaches on this machine,
# and the engine's own bound is 128.
ASYNC_PUTS_IN_FLIGHT = 64
# Threads that read, check and compress the chunk files for those PUTs:
# zstd and the fingerprint release the GIL, so about one per core, plus one
# for the file system calls; more only contend for the GIL.
PREPARE_THREADS = 3


def _dir_manifest(meta_dir: str, max_db_size: int) -> tuple[Optional[str], Optional[fmt.Manifest]]:
    """The manifest of a snapshot's (or staging's) `meta` directory: its
    name and, when it decodes, the manifest (None, None: there is none)."""
    for name in sorted(sp.listdir_or_empty(meta_dir)):
        if fmt.parse_manifest_name(name) is None:
            continue
        try:
            return name, fmt.decode_and_validate(sp.read_regular(os.path.join(meta_dir, name)),
                                                 max_db_size=max_db_size)
        except (OSError, fmt.ManifestError):
            return name, None
    return None, None


class ChunkUploads:
    """The chunk uploads of `copier.Copier` (see the module's docstring)."""

    def _upload_chunk_file(self, db: sp.DbDir, dirpath: str, name: str) -> bool:
        """Upload one chunk file and unlink it; False if it was a bad copy of
        a chunk (moved aside: its snapshot lacks that chunk)."""
        got = self._chunk_blob(db, dirpath, name)
        if isinstance(got, bool):
            return got
        raw_len, blob = got
        self._request(lambda: self.store.chunks.put(name, blob), "put chunk")
        self._uploaded(dirpath, name, raw_len, len(blob))
        return True

    def _uploaded(self, dirpath: str, name: str, raw_len: int, sent_len: int) -> None:
        """A chunk file is in the store: remembered, counted, unlinked."""
        self.recent.add(name)
        self._count(chunks_uploaded=1, chunk_bytes_raw=raw_len, chunk_bytes_sent=sent_len)
        sp.unlink_quiet(os.path.join(dirpath, name))

    def _chunk_blob(self, db: sp.DbDir, dirpath: str, name: str) -> tuple[int, bytes] | bool:
        """One chunk file read and checked for upload: (its length, its zstd
        frame), or the outcome when there is nothing to send: True (a chunk
        sent recently, the zero chunk, or gone), False (a bad copy, moved
        aside)."""
        path = os.path.join(dirpath, name)
        try:
            fp = fmt.parse_chunk_name(name)
        except fmt.BadName:
            # Not a chunk at all, so no snapshot can miss it: just move it aside.
            self._dead_letter(db, path, "badname." + name)
            return True
        if name in self.recent or fp == fmt.ZERO_CHUNK_FPRINT:
            if sp.unlink_quiet(path):
                self._count(chunks_skipped=1)
            return True
        try:
            data = sp.read_regular(path, fmt.CHUNK_SIZE + 1)
        except FileNotFoundError:
            if os.path.islink(path):  # a dangling symlink: junk, not a chunk
                self._dead_letter(db, path, "dangling." + name)
                return False
            # Gone: another copier uploaded it, or the writer dropped it (GC,
            # or its link went to `ready`).  A file at `path` by now is a
            # copy the writer staged since: a live chunk, sent at the next
            # pass (until then `staging/chunks` is not empty).
            return True
        except IsADirectoryError:  # or a FIFO, socket, device (NotRegular)
            self._dead_letter(db, path, "dir." + name)
            return False
        if len(data) > fmt.CHUNK_SIZE or (
                self.verify_chunks and fmt.chunk_fingerprint(data) != fp):
            self._dead_letter(db, path, "mismatch." + name)
            return False
        return len(data), fmt.compress_chunk(data)

    def _upload_chunk_dir(self, db: sp.DbDir, dirpath: str, meta_dir: str) -> int:
        """Upload every chunk file in `dirpath` (their manifest is in
        `meta_dir`); the number of bad files."""
        names = sp.listdir_or_empty(dirpath)
        if not names:
            return 0
        if self.packer is not None:
            name, order = _dir_manifest(meta_dir, self.max_db_size)
            if name is None:
                return 0  # no manifest yet: packs are named after it
            return self.packer.pack_chunk_dir(db, dirpath, name, order)
        names, bad = self._upload_chunks_async(db, dirpath, names)
        results = self._pool.map(lambda n: self._upload_chunk_file(db, dirpath, n), names)
        first_error = None
        for ok, value in results:
            if not ok:
                if first_error is None or isinstance(first_error, Stopped):
                    first_error = value
            elif value is False:
                bad += 1
        if first_error is not None:
            raise first_error
        return bad

    def _upload_chunks_async(self, db: sp.DbDir, dirpath: str, names: list[str]) -> tuple[list[str], int]:
        """Upload the chunk files `names` on the store's HTTP engine
        (`put_async`: many PUTs in flight, no thread waiting on each) when
        it has one and uploads are unpaced, as for a first sync; a few
        threads read, check and compress the files meanwhile. Returns the
        number of bad files (moved aside) and the names left to
        `_upload_chunk_file` (which paces, retries, creates a missing bucket
        and says why a request failed): every name without an engine, else
        those whose turn came at a deadline or a stop, or whose PUT failed."""
        puts = self.store.chunks.capabilities().async_puts
        if puts is None or self.bucket.rate or len(names) < 2:
            return names, 0
        in_flight = InFlight(ASYNC_PUTS_IN_FLIGHT)
        failed: list[str] = []

        def send(name: str) -> bool | None:
            """True: sent or nothing to send; False: a bad file, moved
            aside; None: left to `_upload_chunk_file`."""
            deadline = self._deadline
            if self.stop_event.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None
            got = self._chunk_blob(db, dirpath, name)
            if isinstance(got, bool):
                return got
            raw_len, blob = got

            def done(error: StoreError | None) -> None:
                if error is None:
                    self._uploaded(dirpath, name, raw_len, len(blob))
                else:
                    failed.append(name)
                in_flight.leave()

            in_flight.enter()
            try:
                started = puts.put_async(name, blob, done)
            except BaseException:
                in_flight.leave()
                raise
            if not started:
                in_flight.leave()
                return None
            self._count(requests=1)
            return True

        try:
            results = self._prepare_pool.map(send, names)
        finally:
            in_flight.drain()
        left = [n for n, (ok, outcome) in zip(names, results) if not ok or outcome is None]
        bad = sum(1 for ok, outcome in results if ok and outcome is False)
        return left + failed, bad
