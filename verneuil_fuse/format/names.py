"""Blob names: chunk names from fingerprints, manifest names from host + path.

The rules are docs/FORMAT.md's ("Chunks", "Manifest blob name"); they decide which
key a snapshot lands on, so they must match Verneuil byte for byte.
"""
from __future__ import annotations

import os
import re
import socket
from typing import NamedTuple, Optional

from verneuil_fuse.format.umash import (CHUNK_KEY, HOSTNAME_KEY, MANGLING_KEY, PATH_KEY, Fprint, fingerprint,
                                        hash64)

CHUNK_SIZE = 65536  # Fixed by the format: SQLite's largest page size.

# Fingerprint of 65 536 zero bytes under the chunk key: never stored, always
# synthesised (docs/FORMAT.md, "Chunks").
ZERO_CHUNK_FPRINT = Fprint(8155395758008617606, 2728302605148947890)
ZERO_CHUNK_NAME = ZERO_CHUNK_FPRINT.name

# Encoded names this long or longer are shortened (Verneuil's limit, chosen so
# that names stay under S3's 1024-byte keys and usual 255-byte file names).
MANGLE_THRESHOLD = 230
MANGLE_KEEP = 104  # bytes kept from each end of a mangled name

_HOSTNAME_FILE = "/etc/hostname"
_UNRESERVED = frozenset(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789!-_.*'()")
_CHUNK_NAME_RE = re.compile(r"\A([0-9a-f]{16})%2F([0-9a-f]{16})\Z")
_MANIFEST_RE = re.compile(r"\A([0-9a-f]{4})-verneuil:([^:]*):([0-9a-f]{4})/(/.*)\Z", re.S)


class BadName(ValueError):
    """A string that is not a valid chunk or manifest name."""


def parse_chunk_name(name: str) -> Fprint:
    """The fingerprint a chunk name spells; BadName if it spells none."""
    m = _CHUNK_NAME_RE.match(name)
    if not m:
        raise BadName("not a chunk name: %r" % name)
    return Fprint(int(m.group(1), 16), int(m.group(2), 16))


def chunk_fingerprint(data) -> Fprint:
    """Fingerprint of a chunk's bytes under the chunk key."""
    return fingerprint(data, CHUNK_KEY)


def local_hostname() -> str:
    """The first line of /etc/hostname, trimmed (as Verneuil); gethostname()
    only when that file is missing or empty."""
    try:
        with open(_HOSTNAME_FILE, "rb") as f:
            line = f.readline().strip().decode("utf-8", "surrogateescape")
        if line:
            return line
    except OSError:
        pass
    return socket.gethostname()


def percent_encode(raw: bytes) -> str:
    """Every byte but A-Z a-z 0-9 ! - _ . * ' ( ) becomes %XX (uppercase)."""
    return "".join(chr(b) if b in _UNRESERVED else "%%%02X" % b for b in raw)


def _percent_decode(text: str) -> bytes:
    """Inverse of percent_encode; a cut-off escape at either end is dropped."""
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == "%":
            h = text[i + 1:i + 3]
            if len(h) == 2 and all(x in "0123456789ABCDEFabcdef" for x in h):
                out.append(int(h, 16))
            i += 3
        else:
            out.extend(c.encode("utf-8", "surrogateescape"))
            i += 1
    return bytes(out)


def _as_bytes(s) -> bytes:
    return s if isinstance(s, bytes) else os.fsencode(s)


def manifest_name(path, hostname: Optional[str] = None) -> str:
    """The manifest blob name for the database at `path` on `hostname`.

    With no hostname, the local one is used and `path` is made canonical
    (realpath); with a hostname, `path` is taken as written (another host's
    path need not exist here), but it must be absolute.
    """
    if hostname is None:
        hostname = local_hostname()
        path = os.path.realpath(path)
    path_b = _as_bytes(path)
    if not path_b.startswith(b"/"):
        raise BadName("database paths must be absolute: %r" % (path,))
    host_b = _as_bytes(hostname)
    hh = hash64(host_b, HOSTNAME_KEY) % 65536
    ph = hash64(path_b, PATH_KEY) % 65536
    raw = b"%04x-verneuil:%s:%04x/%s" % (hh, host_b, ph, path_b)
    encoded = percent_encode(raw)
    if len(encoded) >= MANGLE_THRESHOLD:
        fp = fingerprint(encoded.encode("ascii"), MANGLING_KEY)
        encoded = encoded[:MANGLE_KEEP] + fp.hex() + encoded[-MANGLE_KEEP:]
    return encoded


class ManifestName(NamedTuple):
    """What a manifest name says: the host, and the path when it is whole.

    For a mangled (shortened) name, `path` is None and `prefix`/`suffix` hold
    what is left of the start of `host:path` and of the path's end.
    """

    hostname: str
    path: Optional[str]
    mangled: bool
    prefix: str = ""
    suffix: str = ""


def parse_manifest_name(name: str) -> Optional[ManifestName]:
    """Read back host and path from a manifest name; None if it is not one."""
    if len(name) == 2 * MANGLE_KEEP + 32 and re.fullmatch(
            r"[0-9a-f]{32}", name[MANGLE_KEEP:MANGLE_KEEP + 32]):
        head = _percent_decode(name[:MANGLE_KEEP]).decode("utf-8", "replace")
        tail = _percent_decode(name[-MANGLE_KEEP:]).decode("utf-8", "replace")
        m = re.match(r"\A[0-9a-f]{4}-verneuil:([^:]*):", head)
        if m:
            rest = head[m.end():]
            return ManifestName(m.group(1), None, True, rest, tail)
    try:
        text = _percent_decode(name).decode("utf-8", "surrogateescape")
    except UnicodeDecodeError:
        return None
    m = _MANIFEST_RE.match(text)
    if not m:
        return None
    return ManifestName(m.group(2), m.group(4), False)
