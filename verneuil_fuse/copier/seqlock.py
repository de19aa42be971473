"""The copier's staged manifests (docs/SPOOL.md): the chunks in
`staging/chunks` uploaded, then the staged manifest uploaded if the
sequence-lock check passes under the database's lock: same file identity
before and after checking that `staging/chunks` is empty and that there is
neither `ready` nor `consuming` (whose manifest is older and would be
uploaded after ours). A manifest the store already holds is not sent again.

Tested by tests/test_copier_unit.py (test_staged_manifest_uploaded_once,
test_seqlock_waits_for_staged_chunks_and_ready, test_identity_changes_on_republish,
test_invalid_staged_manifest_is_skipped_not_deleted).
"""
from __future__ import annotations

import logging
import os

from verneuil_fuse import format as fmt
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.copier.packer import Unplaced
from verneuil_fuse.copier.refusals import BadSnapshot, PastBound

log = logging.getLogger(__name__)


def _raw_fp(raw: bytes) -> fmt.Fprint:
    return fmt.fingerprint(raw, fmt.DIRECTORY_KEY)


class StagingSync:
    """The staged manifests of `copier.Copier` (see the module's docstring)."""

    def _staged_chunks_pending(self, db: sp.DbDir) -> bool:
        return bool(sp.listdir_or_empty(db.sub(sp.STAGING, sp.CHUNKS)))

    def _ready_or_consuming(self, db: sp.DbDir) -> bool:
        return (sp.rmdir_quiet(db.sub(sp.READY)) is not None
                or os.path.lexists(db.sub(sp.CONSUMING)))

    def _sync_staging(self, db: sp.DbDir) -> bool:
        """Upload staged chunks, then the staged manifest if the seqlock check
        passes.  True if anything was done."""
        did = False
        chunks_dir = db.sub(sp.STAGING, sp.CHUNKS)
        if sp.listdir_or_empty(chunks_dir):
            bad = self._upload_chunk_dir(db, chunks_dir, db.sub(sp.STAGING, sp.META))
            did = True
        else:
            bad = 0
        meta_dir = db.sub(sp.STAGING, sp.META)
        for name in sp.listdir_or_empty(meta_dir):
            if fmt.parse_manifest_name(name) is None:
                self._dead_letter(db, os.path.join(meta_dir, name), "staging.badname")
                continue
            did |= self._sync_staged_manifest(db, meta_dir, name, bad)
        return did

    def _sync_staged_manifest(self, db: sp.DbDir, meta_dir: str, name: str, bad: int) -> bool:
        path = os.path.join(meta_dir, name)
        state = self._state(db)
        try:
            ident0 = sp.identity_of_path(path)
        except FileNotFoundError:
            return False
        if state.staged_done.get(name) == ident0 or state.staged_bad.get(name) == ident0:
            return False  # unchanged since we uploaded (or refused) it
        if bad or self._staged_chunks_pending(db) or self._ready_or_consuming(db):
            return False  # not now: chunks in flight (a later pass will see it)
        if self.packer is not None:
            self._prepare_upload(db, path, name)
        with self._db_lock(db):
            # 1. identity of what we read (the file is immutable once published)
            try:
                fd = sp.open_regular(path)
            except FileNotFoundError:
                # A dangling symlink is not the writer's; a file that is
                # there by now is the writer's first manifest (next pass).
                if os.path.islink(path):
                    self._dead_letter(db, path, "staging.dangling")
                return False
            except IsADirectoryError:  # a directory or FIFO is not the writer's
                self._dead_letter(db, path, "staging.notfile")
                return False
            try:
                ident = sp.identity_of_fd(fd)
                with os.fdopen(os.dup(fd), "rb") as f:
                    raw = f.read()
                if state.staged_done.get(name) == ident:
                    return False
                # 2. staging/chunks empty; 3. no ready (nor consuming, whose
                # manifest is older and would be uploaded after ours)
                if self._staged_chunks_pending(db) or self._ready_or_consuming(db):
                    return False
                # 4. identity unchanged.  The descriptor stays open until
                # then: the inode cannot be freed and its number reused by a
                # later manifest (whose identity could then match ours).
                try:
                    if sp.identity_of_path(path) != ident:
                        return False
                except FileNotFoundError:
                    return False
            finally:
                os.close(fd)
            digest = _raw_fp(raw)
            known = state.last_raw.get(name)
            if known == digest or (known is None and self._store_has(name, raw)):
                # Already there (uploaded from `ready`, or by an earlier copier).
                state.staged_done[name] = ident
                state.last_raw[name] = digest
                self._count(manifests_skipped=1)
                return False
            try:
                m = self._validate(raw)
                self._upload_manifest(db, name, raw, m)
            except PastBound as e:
                self._stopped(db, str(e))
                state.staged_bad[name] = ident
                return False
            except (BadSnapshot, Unplaced) as e:
                log.error("staged manifest %s is not uploaded: %s", path, e)
                state.staged_bad[name] = ident
                return False
            state.staged_done[name] = ident
            if self.packer is not None:
                self.packer.after_staged_upload(db, name, ident.ctime_ns)
            return True
