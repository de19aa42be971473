"""What a copier refuses to ship: a spooled snapshot it will not upload
(`BadSnapshot`: moved aside or skipped), one of a database past
`max_db_size` (`PastBound`: the database stops replicating until it is back
under the bound), a database shipped to another chunk store (`OtherStore`).

Tested by tests/test_copier_unit.py (test_invalid_staged_manifest_is_skipped_not_deleted,
test_mismatched_chunk_blocks_its_manifest), tests/test_copier_bound.py and
tests/test_copier_e2e.py.
"""
from __future__ import annotations

from verneuil_fuse.store import StoreError


class BadSnapshot(Exception):
    """A spooled snapshot we will not upload (moved aside or skipped)."""


class PastBound(BadSnapshot):
    """A snapshot of a database past `max_db_size`: the database stops
    replicating until it is back under the bound."""


class OtherStore(StoreError):
    """A database of the spool was shipped to another chunk store: its chunks
    went there and left the spool, so a manifest uploaded to this store would
    name chunks this store does not have. Nothing is uploaded for it."""
