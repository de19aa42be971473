"""How `verneuilctl` and `verneuil` write log lines.

A line names the program and its process, with the time, the level, and the
message: ``2026-11-28T10:15:02.123+0000 verneuilctl[4242] INFO: copier
started: ...``. Where journald already records the time and the program (the
process's stderr is the journal's stream, which systemd says in
``JOURNAL_STREAM``), a line is the level and the message alone.
"""
from __future__ import annotations

import logging
import os
import time

__all__ = ["Formatter", "formatter", "to_journald"]


def to_journald(stream) -> bool:
    """Whether `stream` is the journal's stream for this process: systemd
    sets ``JOURNAL_STREAM`` to its ``device:inode``, which a redirection
    (a file, a pipe) would change."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return value == "%d:%d" % (st.st_dev, st.st_ino)


class Formatter(logging.Formatter):
    """Times in ISO 8601, local time, milliseconds and the zone's offset."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        t = time.localtime(record.created)
        return "%s.%03d%s" % (time.strftime("%Y-%m-%dT%H:%M:%S", t), record.msecs, time.strftime("%z", t))


def formatter(program: str, stream=None, module: bool = False) -> logging.Formatter:
    """The format of `program`'s lines on `stream` (a file when None):
    without time and program for journald; `module` adds the module that
    logged (``catalog``) before the message."""
    where = " %(module)s" if module else ""
    if stream is not None and to_journald(stream):
        return logging.Formatter("%(levelname)s" + where + ": %(message)s")
    return Formatter("%(asctime)s " + program + "[%(process)d] %(levelname)s" + where + ": %(message)s")
