"""The schema of a read: inferred from a query's first rows, or taken from
a table's declared columns; `_source` and `_error` appended."""
from __future__ import annotations

import sqlite3
from typing import Sequence

from pyspark.sql.types import StringType, StructField, StructType

from verneuil_fuse.spark.convert import spark_type
from verneuil_fuse.spark.files import VerneuilSourceError, connect_readonly
from verneuil_fuse.spark.tables import spark_type_of, table_columns

SOURCE_COLUMN = "_source"
ERROR_COLUMN = "_error"
# Databases sampled to infer the schema: types are widened over all of them
# (an INTEGER column holding a REAL in the second file is a double), and a
# column NULL or empty in the first gets its type from the next. A handful
# keeps the driver's work small with thousands of files; a value of another
# type further on is a per-database error (`on_error`), never a silent cast.
INFER_DATABASES = 8


def _extra(fields: list, with_error: bool) -> StructType:
    fields.append(StructField(SOURCE_COLUMN, StringType(), False))
    if with_error:
        fields.append(StructField(ERROR_COLUMN, StringType(), True))
    return StructType(fields)


def check_names(names: Sequence[str], what: str) -> None:
    """Refuse column names that repeat or clash with `_source`/`_error`."""
    if not names:
        raise VerneuilSourceError("%s returns no columns" % what)
    clash = sorted({n for n in names if list(names).count(n) > 1 or n in (SOURCE_COLUMN, ERROR_COLUMN)})
    if clash:
        raise VerneuilSourceError("%s returns columns named %s more than once or reserved (%s, %s): "
                                  "give them other names with AS"
                                  % (what, ", ".join(clash), SOURCE_COLUMN, ERROR_COLUMN))


def infer_schema(paths: Sequence[str], query: str, immutable: bool, rows: int,
                 with_error: bool) -> StructType:
    """Column names from the cursor; types from the first `rows` rows of the
    query on up to INFER_DATABASES databases (fewer once every column has a
    value), widened over all of them. Databases where the query fails are
    passed over; if it fails on all of them, the last error is raised."""
    names: list[str] | None = None
    kinds: list[set] = []
    last: str | None = None
    for path in paths[:INFER_DATABASES]:
        con = None
        try:
            con = connect_readonly(path, immutable)
            try:
                cur = con.execute(query)
                these = [d[0] for d in cur.description or ()]
                sample = cur.fetchmany(rows)
            finally:
                con.close()
        except sqlite3.Error as e:
            if con is not None and con.refused_write:
                raise VerneuilSourceError("queries cannot write (replicas are read-only): %s" % query) from None
            last = "%s: %s" % (path, e)
            continue
        if names is None:
            check_names(these, "the query")
            names = these
            kinds = [set() for _ in names]
        elif these != names:
            continue  # another shape: that database's error, at read time
        for row in sample:
            for i, v in enumerate(row):
                if v is not None:
                    kinds[i].add(type(v))
        if all(kinds):
            break  # every column has a type: no need to run the query on more databases
    if names is None:
        raise VerneuilSourceError("cannot infer the schema of %r: %s" % (query, last))
    return _extra([StructField(n, spark_type(k), True) for n, k in zip(names, kinds)], with_error)


def table_schema(paths: Sequence[str], table: str, columns: list[str] | None, immutable: bool,
                 with_error: bool) -> StructType:
    """The declared columns of `table` (those in `columns` if given, in
    that order) in the first database that has it, as Spark types."""
    last = None
    for path in paths[:INFER_DATABASES]:
        try:
            con = connect_readonly(path, immutable)
            try:
                declared = dict(table_columns(con, table))
                order = [n for n in declared]
            finally:
                con.close()
        except sqlite3.Error as e:
            last = "%s: %s" % (path, e)
            continue
        wanted = columns or order
        missing = [c for c in wanted if c not in declared]
        if missing:
            raise VerneuilSourceError("table %s in %s has no column %s (it has %s)"
                                      % (table, path, ", ".join(missing), ", ".join(order)))
        check_names(wanted, "table %s" % table)
        return _extra([StructField(n, spark_type_of(declared[n]), True) for n in wanted], with_error)
    raise VerneuilSourceError("cannot read table %s: %s" % (table, last))
