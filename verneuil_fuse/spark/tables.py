"""Table mode: a table's declared columns as a Spark schema, and Spark's
filters turned into the SQL WHERE clause that SQLite evaluates exactly as
Spark would.

Only filters whose answer is the same in both are pushed: on a plain column
whose declared type gives SQLite the comparison Spark makes (INTEGER
affinity as long, REAL as double, TEXT as string compared byte by byte,
BOOLEAN as 0/1), with a literal of that same type. Everything else stays
with Spark, which applies it after the read. One difference remains, on
values stored against their column's type: a row SQLite filters out is not
read, so a value that would have been that database's conversion error (a
TEXT in an INTEGER column) raises nothing, and a BLOB or text that is not
UTF-8 in a TEXT column compares by its bytes, not as the decoded string."""
from __future__ import annotations

import math
import re
import sqlite3
from typing import Any, NamedTuple

from pyspark.sql import datasource as ds
from pyspark.sql.types import (BinaryType, BooleanType, ByteType, DataType, DateType, DecimalType, DoubleType,
                               IntegerType, LongType, ShortType, StringType, TimestampType)

# More values than this in an IN list stay with Spark: SQLite binds one
# parameter per value and older builds allow 999 in a statement.
MAX_IN_VALUES = 500
# Largest DECIMAL(p, s) Spark holds; wider declared decimals are doubles.
MAX_DECIMAL_PRECISION = 38


class Column(NamedTuple):
    name: str
    declared: str  # the declared type as written, "" when none
    kind: str  # how SQLite compares it: integer, real, text, boolean, or "" (not pushable)


def quote(name: str) -> str:
    """`name` as an SQL identifier."""
    return '"%s"' % name.replace('"', '""')


def affinity(declared: str) -> str:
    """SQLite's column affinity for a declared type (datatype3.html, 3.1)."""
    d = declared.upper()
    if "INT" in d:
        return "INTEGER"
    if any(s in d for s in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if "BLOB" in d or not d:
        return "BLOB"
    if any(s in d for s in ("REAL", "FLOA", "DOUB")):
        return "REAL"
    return "NUMERIC"


_DECIMAL = re.compile(r"^\s*(?:DECIMAL|NUMERIC)\s*\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*$", re.I)


def spark_type_of(declared: str) -> DataType:
    """The Spark type of a column declared `declared`: booleans, dates and
    times by name, DECIMAL(p, s) as decimal, else by affinity (INTEGER as
    long, REAL and NUMERIC as double, TEXT and untyped as string, BLOB as
    binary)."""
    d = declared.strip().upper()
    if d in ("BOOL", "BOOLEAN"):
        return BooleanType()
    if d == "DATE":
        return DateType()
    if d in ("DATETIME", "TIMESTAMP"):
        return TimestampType()
    m = _DECIMAL.match(d)
    if m and int(m.group(1)) <= MAX_DECIMAL_PRECISION:
        return DecimalType(int(m.group(1)), int(m.group(2) or 0))
    a = affinity(d)
    if a == "INTEGER":
        return LongType()
    if a in ("REAL", "NUMERIC"):
        return DoubleType()
    if a == "BLOB" and d:
        return BinaryType()
    return StringType()


def compare_kind(declared: str, dtype: DataType) -> str:
    """How filters on a column compare in SQLite, if exactly as in Spark
    for this Spark type; "" when none is pushed."""
    a = affinity(declared)
    if a == "INTEGER" and isinstance(dtype, (LongType, IntegerType, ShortType, ByteType)):
        return "integer"
    if a == "REAL" and isinstance(dtype, DoubleType):
        return "real"
    if a == "TEXT" and isinstance(dtype, StringType):
        return "text"
    if declared.strip().upper() in ("BOOL", "BOOLEAN") and isinstance(dtype, BooleanType):
        return "boolean"
    return ""


def table_columns(con: sqlite3.Connection, table: str) -> list[tuple[str, str]]:
    """(name, declared type) of each column of `table` (a table or a view);
    sqlite3.OperationalError if there is no such table."""
    cols = [(r[1], r[2] or "") for r in con.execute("PRAGMA table_info(%s)" % quote(table))]
    if not cols:
        raise sqlite3.OperationalError("no such table: %s" % table)
    return cols


def _literal_ok(kind: str, value: Any) -> bool:
    if kind == "integer":
        return type(value) is int
    if kind == "real":
        return type(value) in (int, float) and not (isinstance(value, float) and math.isnan(value))
    if kind == "text":
        return type(value) is str
    if kind == "boolean":
        return type(value) is bool
    return False


_COMPARISONS = {ds.EqualTo: "=", ds.GreaterThan: ">", ds.GreaterThanOrEqual: ">=",
                ds.LessThan: "<", ds.LessThanOrEqual: "<="}
# Boolean columns: only equality, SQLite stores them as 0 and 1.
_BOOLEAN_FILTERS = (ds.EqualTo, ds.EqualNullSafe, ds.In, ds.IsNull, ds.IsNotNull, ds.Not)


def _bind(kind: str, value):
    return int(value) if kind == "boolean" else value


def to_sql(f: ds.Filter, kinds: dict[str, str]) -> tuple[str, list] | None:
    """`f` as an SQL condition and its parameters, or None if SQLite would
    not give exactly Spark's answer (then Spark applies it)."""
    if isinstance(f, ds.Not):
        inner = to_sql(f.child, kinds)
        return None if inner is None else ("NOT (%s)" % inner[0], inner[1])
    attr = getattr(f, "attribute", None)
    if not (isinstance(attr, tuple) and len(attr) == 1 and kinds.get(attr[0])):
        return None
    kind, col = kinds[attr[0]], quote(attr[0])
    if kind == "boolean" and not isinstance(f, _BOOLEAN_FILTERS):
        return None
    # Text compares byte by byte, as Spark's strings do, whatever collation
    # the column was declared with.
    collate = " COLLATE BINARY" if kind == "text" else ""
    if isinstance(f, ds.IsNull):
        return "%s IS NULL" % col, []
    if isinstance(f, ds.IsNotNull):
        return "%s IS NOT NULL" % col, []
    if type(f) in _COMPARISONS and _literal_ok(kind, f.value):
        return "%s %s ?%s" % (col, _COMPARISONS[type(f)], collate), [_bind(kind, f.value)]
    if isinstance(f, ds.EqualNullSafe):
        if f.value is None:
            return "%s IS NULL" % col, []
        if _literal_ok(kind, f.value):
            return "%s IS ?%s" % (col, collate), [_bind(kind, f.value)]
        return None
    if isinstance(f, ds.In):
        values = list(f.value)
        if not values or len(values) > MAX_IN_VALUES or not all(_literal_ok(kind, v) for v in values):
            return None
        return ("%s%s IN (%s)" % (col, collate, ", ".join("?" * len(values))),
                [_bind(kind, v) for v in values])
    if kind == "text" and isinstance(f, (ds.StringStartsWith, ds.StringEndsWith, ds.StringContains)):
        return _substring(f, col)
    return None


def _substring(f, col: str) -> tuple[str, list] | None:
    """Prefix, suffix and substring tests, case-sensitive (LIKE is not)."""
    v = f.value
    if type(v) is not str:
        return None
    if not v:
        return "%s IS NOT NULL" % col, []
    if isinstance(f, ds.StringStartsWith):
        return "substr(%s, 1, ?) = ? COLLATE BINARY" % col, [len(v), v]
    if isinstance(f, ds.StringEndsWith):
        return "substr(%s, ?) = ? COLLATE BINARY" % col, [-len(v), v]
    return "instr(%s, ?) > 0" % col, [v]


def describe(f: ds.Filter) -> str:
    """A filter as Spark SQL-like text, for logs."""
    if isinstance(f, ds.Not):
        return "NOT (%s)" % describe(f.child)
    name = ".".join(getattr(f, "attribute", ()) or ())
    return "%s %s %r" % (name, type(f).__name__, getattr(f, "value", None))
