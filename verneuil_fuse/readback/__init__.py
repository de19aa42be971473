"""Reading a store back: what turns the store's replicas into files and
reports again, beside the copier that ships them and the mount that serves
them. See docs/COPIER.md ("Restore", "History", "Repair").

- `restore`: rebuild a database file from a manifest and its chunks, every
  one verified (`fetch_manifest`, `write_snapshot`, `restore_to_path`,
  `restore_bytes`); `verneuilctl restore`.
- `versions`: a database's stored versions, their times and whether their
  chunks are all there, and the version current at a time; `verneuilctl
  versions`, `restore --at`.
- `repair`: upload again, from the source file, the chunks a database's
  manifest names and the store lost; `verneuilctl repair`.

Every read goes through the store's one verified read (`store.Reads`);
failures are one `store.ReadError` line each.
"""
from __future__ import annotations

from verneuil_fuse.readback.restore import fetch_manifest, restore_bytes, restore_to_path, write_snapshot

__all__ = ["fetch_manifest", "restore_bytes", "restore_to_path", "write_snapshot"]
