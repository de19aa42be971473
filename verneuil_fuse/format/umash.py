"""UMASH hashes and fingerprints for Python: a thin binding to csrc/umash.c.

There is no second implementation in Python: every value comes from the C
code the writer VFS also uses.  cffi releases the GIL around each C call, so
hashing long buffers does not stall other threads.
"""
from __future__ import annotations

from typing import NamedTuple

from verneuil_fuse.format._umash import ffi, lib

# The parameter keys of docs/FORMAT.md, as given (the binding zero-pads to 32 bytes).
CHUNK_KEY = b"verneuil db chunk params"
DIRECTORY_KEY = b"verneuil db directory params"
HEADER_KEY = b"verneuil sqlite header params"
PATH_KEY = b"verneuil path params"
HOSTNAME_KEY = b"verneuil hostname params"
MANGLING_KEY = b"verneuil path mangling params"

KEYS = {
    "chunk": CHUNK_KEY,
    "directory": DIRECTORY_KEY,
    "header": HEADER_KEY,
    "path": PATH_KEY,
    "hostname": HOSTNAME_KEY,
    "mangling": MANGLING_KEY,
}

IMPLS = {"auto": 0, "portable": 1, "clmul": 2}

_KEY_BYTES = 32


class Fprint(NamedTuple):
    """A 128-bit UMASH fingerprint: major = primary hash, minor = secondary."""

    major: int
    minor: int

    @property
    def name(self) -> str:
        """The chunk name of docs/FORMAT.md: `%016x%2F%016x`."""
        return "%016x%%2F%016x" % (self.major, self.minor)

    def hex(self) -> str:
        """32 lowercase hex digits, major then minor (as in mangled names)."""
        return "%016x%016x" % (self.major, self.minor)


_params_cache: dict[bytes, object] = {}


def params_for(key: bytes):
    """The derived parameters (a cdata struct) for `key`, derived once."""
    params = _params_cache.get(key)
    if params is None:
        if len(key) > _KEY_BYTES:
            raise ValueError("UMASH keys are at most 32 bytes, got %d" % len(key))
        params = ffi.new("struct vn_umash_params *")
        lib.vn_umash_params_derive(params, 0, key.ljust(_KEY_BYTES, b"\0"))
        _params_cache[key] = params
    return params


def fingerprint(data, key: bytes = CHUNK_KEY) -> Fprint:
    """The 128-bit fingerprint of `data` (any bytes-like) under `key`."""
    buf = ffi.from_buffer(data)
    fp = lib.vn_umash_fprint(params_for(key), 0, buf, len(buf))
    return Fprint(fp.hash[0], fp.hash[1])


def hash64(data, key: bytes) -> int:
    """The primary 64-bit UMASH hash of `data` under `key`."""
    buf = ffi.from_buffer(data)
    return lib.vn_umash_full(params_for(key), 0, 0, buf, len(buf))


def derived_params(key: bytes) -> dict:
    """The derived parameter words, for checks against the reference."""
    p = params_for(key)
    return {"poly": [[p.poly[i][0], p.poly[i][1]] for i in range(2)],
            "oh": [p.oh[i] for i in range(len(p.oh))]}


def select_impl(name: str) -> str:
    """Select "auto", "portable" or "clmul"; returns the name now active."""
    try:
        wanted = IMPLS[name]
    except KeyError:
        raise ValueError("unknown UMASH implementation %r" % name) from None
    lib.vn_umash_select_impl(wanted)
    return active_impl()


def active_impl() -> str:
    """The name of the implementation in use ("portable" or "clmul")."""
    return {1: "portable", 2: "clmul"}[lib.vn_umash_active_impl()]
