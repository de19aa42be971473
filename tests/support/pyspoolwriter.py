"""A reference spool writer in Python (tests only), following docs/SPOOL.md.

The real writer is the C VFS (csrc/, writer_vfs/); this one snapshots a
whole file on demand.  Tests and benchmarks use it to build spools without
SQLite in the loop (or for files written some other way), and it documents
the protocol the copiers rely on in a few lines.  It is not wait-free in
the sense the VFS is (it reads the whole file), but it follows the same
atomic publish rules, so copiers cannot tell the difference.
"""
from __future__ import annotations

import errno
import os
import shutil
import uuid
from typing import Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.copier import spool as sp


class SpoolWriter:
    """Snapshots `db_path` into `spool_dir` (call `snapshot()` after each
    commit, while no other write can happen)."""

    def __init__(self, spool_dir: str, db_path: str, hostname: Optional[str] = None):
        self.spool_dir = spool_dir
        self.db_path = os.path.realpath(db_path)
        self.hostname = hostname
        self.name = fmt.manifest_name(self.db_path, hostname)
        self.bundle: tuple[int, ...] = ()  # chunks bundled besides chunk 0
        root = os.path.join(spool_dir, sp.current_boot_root_name())
        self.db = sp.DbDir(root, sp.dbdir_name(self.db_path))
        for sub in ((sp.STAGING, sp.CHUNKS), (sp.STAGING, sp.META), (sp.STAGING, sp.SCRATCH)):
            os.makedirs(self.db.sub(*sub), exist_ok=True)
        if not os.path.exists(self.db.sub(sp.SOURCE)):
            tmp = self._scratch()
            with open(tmp, "wb") as f:
                f.write(os.fsencode(self.db_path))
            os.chmod(tmp, 0o444)
            os.rename(tmp, self.db.sub(sp.SOURCE))

    def _scratch(self) -> str:
        return self.db.sub(sp.STAGING, sp.SCRATCH, uuid.uuid4().hex)

    def _publish(self, data: bytes, target: str) -> None:
        tmp = self._scratch()
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o444)
        os.rename(tmp, target)

    def staged_manifest(self) -> Optional[fmt.Manifest]:
        try:
            with open(self.db.sub(sp.STAGING, sp.META, self.name), "rb") as f:
                return fmt.decode_and_validate(f.read())
        except (FileNotFoundError, fmt.ManifestError):
            return None

    def snapshot(self, version_id: bytes = b"") -> fmt.Manifest:
        with open(self.db_path, "rb") as f:
            data = f.read()
        st = os.stat(self.db_path)
        m, blobs = fmt.snapshot_of(data, version_id=version_id, ctime=int(st.st_ctime),
                                   ctime_ns=st.st_ctime_ns % 1_000_000_000, bundle=self.bundle)
        previous = self.staged_manifest()
        known = set(previous.chunks) if previous is not None else set()
        chunks_dir = self.db.sub(sp.STAGING, sp.CHUNKS)
        # 1. stage the chunks the snapshot needs and the previous one did not
        for fp, blob in blobs.items():
            if fp not in known:
                self._publish(blob, os.path.join(chunks_dir, fp.name))
        # 2. publish the manifest (always a new inode)
        raw = fmt.encode_manifest(m)
        self._publish(raw, self.db.sub(sp.STAGING, sp.META, self.name))
        # 3. refresh `ready` if it is missing or empty
        needed = {fp.name for fp in blobs}
        self._publish_ready(raw, needed)
        # 4. GC: staged chunks the manifest does not name
        for name in sp.listdir_or_empty(chunks_dir):
            if name not in needed:
                sp.unlink_quiet(os.path.join(chunks_dir, name))
        return m

    def _publish_ready(self, raw: bytes, needed: set) -> bool:
        ready = self.db.sub(sp.READY)
        if sp.listdir_or_empty(ready):
            return False
        top = self._scratch()
        snap = os.path.join(top, str(uuid.uuid4()))
        os.makedirs(os.path.join(snap, sp.CHUNKS))
        os.makedirs(os.path.join(snap, sp.META))
        chunks_dir = self.db.sub(sp.STAGING, sp.CHUNKS)
        for name in sp.listdir_or_empty(chunks_dir):
            if name in needed:
                try:
                    os.link(os.path.join(chunks_dir, name), os.path.join(snap, sp.CHUNKS, name))
                except FileNotFoundError:
                    pass  # uploaded meanwhile by a copier: it is in the store
        with open(os.path.join(snap, sp.META, self.name), "wb") as f:
            f.write(raw)
        os.chmod(os.path.join(snap, sp.META, self.name), 0o444)
        try:
            os.rename(top, ready)
        except OSError as e:
            shutil.rmtree(top, ignore_errors=True)
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
        # Published: every staged chunk is now either useless or in `ready`.
        for name in sp.listdir_or_empty(chunks_dir):
            sp.unlink_quiet(os.path.join(chunks_dir, name))
        return True
