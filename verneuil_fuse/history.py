"""A database's past states: the time of each manifest version, the version
current at a given time, and how times are written.

A database's history is the list of its manifest's versions in the store
(`Backend.list_versions`: a versioned S3 bucket, or a directory store's kept
versions), in the order the store received them.  The *time* of a version is
the source file's ctime its manifest carries (nanoseconds; the moment the
database was in that state, also the mtime the mount shows) when the manifest
can be read and the ctime is plausible, else the store's time of the upload.

The state at time T is the newest version, in the store's order, whose
time is at or before T (a version whose time is exactly T counts).  Times
usually grow along the history (copiers upload a database's manifests in
order, COPIER.md), but not when the writer's clock stepped back: versions
at +10, +30, +20, +40 s give +20 at +22 and +35.  So `newest_at` walks the
history from the newest version back until one is that old: one manifest
read per version newer than the one chosen (none past the first when T is
after the newest version, the common case).

Times are written (`parse_time`) as ISO 8601: ``2026-11-26``,
``2026-11-26T19:00``, ``2026-11-26T19:00:00``, with up to 9 decimals of
seconds, ``T`` or a space between date and time, and a zone ``Z``,
``+02:00``, ``+0200`` or ``+02`` (none: UTC); or relative to now:
``-2h``, ``-30m``, ``-1d``, ``-1h30m``, ``-90s``, ``-1w``.  `format_time`
writes the form `parse_time` reads back to the nanosecond (UTC, ``Z``).

Used by `verneuilctl versions` / `restore --at` (through `readback.versions`,
which reads the versions from the store) and by the mount's past states
(`reader.past`, through `newest_at_async`).
"""
from __future__ import annotations

import datetime
import re
import time
from typing import Any, Awaitable, Callable, Optional

NS = 1_000_000_000
# Latest time accepted from a manifest, in seconds: 2**63 - 1 nanoseconds
# (year 2262), the most a file time can hold (and what the mount can show).
MAX_TIME_S = ((1 << 63) - 1) // NS - 1
# The times `parse_time` accepts, in nanoseconds: what a signed 64-bit
# count of nanoseconds holds (1677-09-21 to 2262-04-11), the range of every
# time the store, the mount and `format_time` deal in. Anything outside is
# `BadTime`, one line, not an overflow deep inside.
MIN_TIME_NS = -(1 << 63)
MAX_TIME_NS = (1 << 63) - 1

# ISO 8601 date, optional time (minutes or seconds, up to 9 decimals) and
# optional zone.
_ISO_RE = re.compile(
    r"\A(\d{4})-(\d{2})-(\d{2})"
    r"(?:[Tt ](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d{1,9}))?)?)?"
    r"(?:([Zz])|([+-])(\d{2})(?::?(\d{2}))?)?\Z")
# A relative time: a minus sign, then one or more number + unit.
RELATIVE_RE = re.compile(r"\A-((?:\d+(?:\.\d+)?[smhdw])+)\Z")
_RELATIVE_PART_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Longest time text accepted (the longest ISO form is 35 characters): a name
# looked up on the mount may be anything up to 255 bytes.
MAX_TIME_TEXT = 64


class BadTime(ValueError):
    """A time that `parse_time` cannot read; the message is one line."""


def parse_time(text: str, now_ns: Optional[int] = None) -> int:
    """Nanoseconds since the epoch of an ISO 8601 or relative time (module
    docstring); `now_ns` (default: the clock) anchors relative times."""
    if not isinstance(text, str) or len(text) > MAX_TIME_TEXT:
        raise BadTime("not a time: %r" % (text if isinstance(text, str) else type(text).__name__))
    at = _parse(text, now_ns)
    if not MIN_TIME_NS <= at <= MAX_TIME_NS:
        raise BadTime("not a time: %r (out of range: times go from %s to %s)"
                      % (text, format_time(MIN_TIME_NS), format_time(MAX_TIME_NS)))
    return at


def _parse(text: str, now_ns: Optional[int]) -> int:
    """`parse_time` before its range check (any integer)."""
    stripped = text.strip()
    rel = RELATIVE_RE.match(stripped)
    if rel is not None:
        ago = sum(int(round(float(n) * _UNIT_SECONDS[u] * NS)) for n, u in _RELATIVE_PART_RE.findall(rel.group(1)))
        now = time.time_ns() if now_ns is None else now_ns
        return now - ago
    m = _ISO_RE.match(stripped)
    if m is None:
        raise BadTime("not a time: %r (use ISO 8601 such as 2026-11-26T19:00:00Z, or -2h, -30m, -1d)"
                      % text)
    year, month, day, hour, minute, second, frac, zulu, sign, zh, zm = m.groups()
    try:
        moment = datetime.datetime(int(year), int(month), int(day), int(hour or 0), int(minute or 0),
                                   int(second or 0), tzinfo=datetime.timezone.utc)
    except ValueError as e:
        raise BadTime("not a time: %r (%s)" % (text, e)) from None
    offset = 0
    if sign is not None:
        hours, minutes = int(zh), int(zm or 0)
        if hours > 23 or minutes > 59:
            raise BadTime("not a time: %r (bad zone offset)" % text)
        offset = (hours * 3600 + minutes * 60) * (1 if sign == "+" else -1)
    seconds = int(moment.timestamp()) - offset
    nanos = int((frac or "0").ljust(9, "0"))
    return seconds * NS + nanos


def format_time(ns: int) -> str:
    """``2026-11-26T19:00:00.123456789Z`` (decimals only as many as needed),
    which `parse_time` reads back to the same nanosecond."""
    seconds, nanos = divmod(int(ns), NS)
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    if nanos:
        text += "." + ("%09d" % nanos).rstrip("0")
    return text + "Z"


def version_time_ns(manifest: Any, store_time: float) -> tuple[int, str]:
    """(time in ns, "manifest" or "store"): the manifest's ctime when it is
    plausible (1970 to `MAX_TIME_S`, nanoseconds below one second), else the
    store's time of the upload.  `manifest` may be None (unreadable)."""
    if manifest is not None:
        seconds, nanos = manifest.ctime, manifest.ctime_ns
        if 0 < seconds <= MAX_TIME_S and 0 <= nanos < NS:
            return seconds * NS + nanos, "manifest"
    store_time = store_time if 0 <= store_time <= MAX_TIME_S else 0
    return int(round(store_time * NS)), "store"


def newest_at(count: int, at_ns: int, time_of: Callable[[int], int]) -> Optional[int]:
    """Index of the newest of `count` versions (in the store's order, oldest
    first) whose time (`time_of(index)`) is at or before `at_ns`; None when
    none is that old. Walks back from the newest (module docstring)."""
    for index in range(count - 1, -1, -1):
        if time_of(index) <= at_ns:
            return index
    return None


# `newest_at_async` asks for the times of this many versions at once (the
# mount reads their manifests in parallel, behind its own bound), after the
# newest alone.
TIMES_AT_ONCE = 8


async def newest_at_async(count: int, at_ns: int,
                          times_of: Callable[[list[int]], Awaitable[list[int]]]) -> Optional[int]:
    """`newest_at` for the mount: `times_of(indices)` gives the times of
    several versions at once; the newest alone first, then
    `TIMES_AT_ONCE` at a time going back."""
    top = count
    batch = 1
    while top > 0:
        indices = list(range(top - 1, max(-1, top - 1 - batch), -1))
        for index, t in zip(indices, await times_of(indices)):
            if t <= at_ns:
                return index
        top = indices[-1]
        batch = TIMES_AT_ONCE
    return None
