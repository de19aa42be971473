"""The nodes of the catalog's tree (`catalog.Catalog`): directories, the
databases known by name from a listing (`DbEntry`), the versions whose
decoded manifest left memory (`Parked`), the control files, and a
replica's mtime from its manifest.

Tested through tests/test_reader_catalog.py (test_display_paths,
test_tree_versions_and_removal, test_manifests_read_on_lookup_and_parked_past_the_bound).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from verneuil_fuse.reader.replica import Replica


# Latest ctime taken from a manifest, in seconds: 2**63 - 1 nanoseconds
# (year 2262), the most a file time can hold in the kernel's attributes.
MAX_CTIME_S = ((1 << 63) - 1) // 1_000_000_000 - 1
# A manifest fetched less than this many seconds after its listed mtime is
# fetched again at the next poll, and not taken from the manifest cache:
# two uploads within one second of the same size must not be missed (the
# listing's mtime has a resolution of a second).
SETTLE_SECONDS = 5.0
# The control directory at the root of the tree (stats, metrics, other/).
CONTROL_DIR = ".verneuil"


@dataclass
class Directory:
    inode: int
    name: str
    parent: "Directory | None" = field(repr=False)
    entries: dict[str, "Directory | DbEntry"] = field(default_factory=dict, repr=False)
    mtime_ns: int = 0

    @property
    def path(self) -> str:
        parts = []
        node: Directory | None = self
        while node is not None and node.parent is not None:
            parts.append(node.name)
            node = node.parent
        return "/" + "/".join(reversed(parts))


@dataclass(slots=True, eq=False)
class DbEntry:
    """A database in the tree, known by name from the listing.

    ``current`` is its newest version when its manifest was read since the
    listing last changed (a decoded `Replica` or a `Parked` one), else None:
    then ``inode`` is the inode its next version gets, the catalog maps it
    to this entry, and ``lookups`` counts the kernel's references to it."""

    key: str
    name: str
    parent: Directory = field(repr=False)
    size: int  # listed size of the manifest blob
    listed_mtime: float
    inode: int
    fetched_at: float = 0.0  # when its manifest was last fetched (0: not since listed)
    current: "Replica | Parked | None" = field(default=None, repr=False)
    lookups: int = 0


@dataclass(slots=True, eq=False)
class Parked:
    """A version whose decoded manifest left memory (see the module
    docstring): what its attributes and the stats need."""

    key: str
    path: str
    inode: int
    size: int
    mtime_ns: int
    version: str
    nchunks: int
    lookups: int
    reads: int
    read_bytes: int
    preloaded: int
    opens: int = 0

    @classmethod
    def of(cls, r: Replica) -> "Parked":
        return cls(r.key, r.path, r.inode, r.size, r.mtime_ns, r.version, r.nchunks, r.lookups, r.reads,
                   r.read_bytes, r.preloaded)


class Stale(Exception):
    """A parked version the store no longer serves (ESTALE)."""


@dataclass
class StatsFile:
    inode: int
    render: Callable[[], bytes]


def mtime_ns_of(manifest, listed_mtime: float) -> int:
    """A replica's mtime: the source's ctime the manifest carries when it is
    a plausible time (from 1970 to `MAX_CTIME_S`, nanoseconds below one
    second), else the listed mtime of the manifest blob. A manifest is
    written by whoever can write the store; its times must not reach the
    kernel unchecked."""
    seconds, nanos = manifest.ctime, manifest.ctime_ns
    if 0 < seconds <= MAX_CTIME_S and 0 <= nanos < 1_000_000_000:
        return seconds * 1_000_000_000 + nanos
    listed = listed_mtime if 0 <= listed_mtime <= MAX_CTIME_S else 0
    return int(listed * 1e9)
