"""The data source's options, parsed and checked once, with clear errors."""
from __future__ import annotations

import json
import os
import re

from verneuil_fuse.spark.files import DEFAULT_PARTITION_BYTES, VerneuilSourceError, find_databases

# Enough rows to see a non-NULL value in most columns, few enough to be cheap.
DEFAULT_INFER_ROWS = 100
ON_ERROR = ("fail", "skip", "report")
# Every option the data source reads; any other (a typo such as "on_eror")
# is an error, not silently ignored.
OPTIONS = ("query", "table", "columns", "path", "paths", "on_error", "immutable", "infer_rows",
           "partitions", "partition_bytes", "min_partitions", "arrow", "pushdown")
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)i?b?\s*$", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _flag(options: dict, name: str, default: bool) -> bool:
    value = str(options.get(name, default)).strip().lower()
    if value not in _TRUE + _FALSE:
        raise VerneuilSourceError("option %s must be true or false, not %r" % (name, options[name]))
    return value in _TRUE


def _positive(options: dict, name: str, default):
    if name not in options:
        return default
    try:
        value = int(options[name])
    except ValueError:
        value = 0
    if value < 1:
        raise VerneuilSourceError("option %s must be a positive integer, not %r" % (name, options[name]))
    return value


def _size(options: dict, name: str, default: int) -> int:
    if name not in options:
        return default
    m = _SIZE.match(str(options[name]))
    value = int(m.group(1)) * _UNITS[m.group(2).lower()] if m else 0
    if value < 1:
        raise VerneuilSourceError("option %s must be a size such as 64m or 1g, not %r"
                                  % (name, options[name]))
    return value


class Options:
    """What the user asked for: the SQL (`query`) or the table, the
    databases, error handling and the partitioning."""

    def __init__(self, options: dict):
        unknown = sorted(k for k in options if k.lower() not in OPTIONS)
        if unknown:
            raise VerneuilSourceError("unknown option%s %s; the verneuil source takes %s"
                                      % ("s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(OPTIONS)))
        self.query = options.get("query")
        self.table = options.get("table")
        if bool(self.query) == bool(self.table):
            raise VerneuilSourceError('give option "query" (any SQL) or option "table" (a table '
                                      "name, with filter pushdown), not %s"
                                      % ("both" if self.query else "neither"))
        columns = options.get("columns")
        if columns is not None and not self.table:
            raise VerneuilSourceError('option "columns" goes with "table" (a query names its own)')
        self.columns = [c.strip() for c in columns.split(",") if c.strip()] if columns else None
        self.paths = find_databases(self._spec(options))
        self.on_error = options.get("on_error", "fail")
        if self.on_error not in ON_ERROR:
            raise VerneuilSourceError("on_error must be one of %s" % ", ".join(ON_ERROR))
        self.immutable = _flag(options, "immutable", True)
        self.arrow = _flag(options, "arrow", True)
        self.pushdown = _flag(options, "pushdown", True)
        self.infer_rows = _positive(options, "infer_rows", DEFAULT_INFER_ROWS)
        self.partitions = _positive(options, "partitions", None)
        self.partition_bytes = _size(options, "partition_bytes", DEFAULT_PARTITION_BYTES)
        # The planning runs in a Python worker, which cannot ask Spark for
        # its parallelism: the driver host's cores stand in for local[*].
        self.min_partitions = _positive(options, "min_partitions", os.cpu_count() or 1)

    @staticmethod
    def _spec(options: dict):
        if "paths" in options:
            try:
                return json.loads(options["paths"])
            except ValueError:
                return [p for p in options["paths"].split(",") if p]
        if "path" in options:
            return options["path"]
        raise VerneuilSourceError("give a path to load() or option \"paths\"")
