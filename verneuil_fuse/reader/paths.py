"""Where a manifest key is shown in the mount: ``/<hostname>/<path>``.

`display_path` turns a manifest name (docs/FORMAT.md, "Manifest blob name")
into a host and path components; `key_of` goes back, for a path the
catalog has not listed yet.

Names that do not read back as a whole path:
- a *mangled* manifest name (docs/FORMAT.md: names of 230 encoded bytes or more
  keep their first and last 104 encoded bytes around a fingerprint) is shown
  under ``/<hostname>/`` as ``<leading dirs>/…<12 hex>…/<trailing dirs and
  file>``: the whole path components that survive at each end (a cut may
  split a component, an escape or a UTF-8 sequence; partial components are
  dropped), with a directory named after the first 12 hex digits of the
  mangling fingerprint standing for the missing middle, so that two long paths
  sharing both ends still get distinct, stable names (when the kept end holds
  no ``/``, the mark prefixes what is left of the file name);
- a manifest key that is not a manifest name at all (but whose blob is a valid
  manifest) is shown as ``/.verneuil/other/<key>``.
Path components ``.``, ``..`` and empty ones cannot be directory entries:
empty and ``.`` are dropped, ``..`` becomes ``%2E%2E``. A database whose path
is also a directory of another one keeps the directory and is left out, with
a warning.
"""
from __future__ import annotations

import re
from urllib.parse import unquote

from verneuil_fuse.format import manifest_name, parse_manifest_name
from verneuil_fuse.format.names import MANGLE_KEEP

_MANGLED_HEAD = re.compile(r"\A[0-9a-f]{4}-verneuil%3A.*?%3A[0-9a-f]{4}%2F(%2F.*)\Z", re.S)


def _clean(components: list[str]) -> list[str]:
    out = []
    for c in components:
        if c in ("", "."):
            continue
        # A NUL cannot be in a file name (the kernel would cut it there).
        out.append("%2E%2E" if c == ".." else c.replace("\0", "%00"))
    return out


def display_path(key: str) -> tuple[str, list[str]] | None:
    """(hostname, path components) where manifest ``key`` is shown, or None
    for a key that is not a manifest name."""
    parsed = parse_manifest_name(key)
    if parsed is None:
        return None
    host = parsed.hostname
    if host in ("", ".", ".."):
        host = host.replace(".", "%2E") or "%2E"
    # The host is one directory name: no "/" (nor NUL) may split it.
    host = host.replace("/", "%2F").replace("\0", "%00")
    if not parsed.mangled:
        return host, _clean(parsed.path.split("/"))
    # Mangled: <first 104 encoded bytes><32 hex><last 104 encoded bytes>.
    # Keep the whole path components on each side (a cut may split a
    # component, a %XX escape or a UTF-8 sequence), and name the missing
    # middle after the mangling fingerprint.
    head, tail = key[:MANGLE_KEEP], key[MANGLE_KEEP + 32 :]
    m = _MANGLED_HEAD.match(head)
    if m is None:
        return None
    prefix = m.group(1)
    prefix = prefix[: prefix.rfind("%2F")] if "%2F" in prefix else ""
    cut = tail.find("%2F")
    suffix = tail[cut + 3 :] if cut >= 0 else tail
    middle = "\u2026" + key[MANGLE_KEEP : MANGLE_KEEP + 12] + "\u2026"
    parts = _clean(unquote(prefix, errors="replace").split("/"))
    if cut < 0:  # the end of one long file name: the mark and the end make one name
        end = unquote(suffix, errors="replace").replace("/", "%2F").replace("\0", "%00")
        return host, parts + [middle + end]
    parts.append(middle)
    parts.extend(_clean(unquote(suffix, errors="replace").split("/")))
    return host, parts


def key_of(host: str, parts: list[str]) -> str | None:
    """The manifest key shown at ``/<host>/<parts...>``, or None when no key
    is shown there exactly (a name `display_path` escapes or shortens)."""
    try:
        key = manifest_name("/" + "/".join(parts), host)
    except ValueError:
        return None
    return key if display_path(key) == (host, parts) else None
