"""`format("verneuil")`: the PySpark data source and its readers.

A reader runs one SQL statement on each database of its partition: the
user's query, or in table mode a SELECT of the table's columns with the
filters Spark pushed down as its WHERE clause. Rows leave it as Arrow
record batches (or tuples with option arrow=false), one database at a time,
so a database that fails (`on_error`) contributes nothing but its error."""
from __future__ import annotations

import logging
import sqlite3
from typing import Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, Filter, InputPartition
from pyspark.sql.types import StructType

from verneuil_fuse.spark.convert import SUPPORTED_TYPES, ColumnBuilder, ConversionError, arrow_schema, convert
from verneuil_fuse.spark.files import (DatabaseError, VerneuilSourceError, balance, connect_readonly,
                                       explain_failure, is_decode_error, plan_by_bytes)
from verneuil_fuse.spark.options import Options
from verneuil_fuse.spark.schema import ERROR_COLUMN, INFER_DATABASES, SOURCE_COLUMN, infer_schema, table_schema
from verneuil_fuse.spark.tables import compare_kind, describe, quote, spark_type_of, table_columns, to_sql

log = logging.getLogger("verneuil_fuse.spark")

# Rows per Arrow record batch: large enough that the per-batch cost (one
# pyarrow call per column) is small, small enough to bound a task's memory
# on wide rows (Spark's own default, spark.sql.execution.arrow.maxRecordsPerBatch).
BATCH_ROWS = 10_000
_HINT_INFERRED = ("types were inferred from the first databases: give the schema with "
                  ".schema(...) if they differ")
_HINT_DECLARED = "types come from the table's declared columns: give .schema(...) to read it otherwise"


class VerneuilDataSource(DataSource):
    """`format("verneuil")`: one SQL query, or one table, over many SQLite
    databases."""

    @classmethod
    def name(cls) -> str:
        return "verneuil"

    def schema(self) -> StructType:
        opts = Options(self.options)
        if opts.table:
            return table_schema(opts.paths, opts.table, opts.columns, opts.immutable,
                                opts.on_error == "report")
        return infer_schema(opts.paths, opts.query, opts.immutable, opts.infer_rows,
                            opts.on_error == "report")

    def reader(self, schema: StructType) -> "VerneuilReader":
        opts = Options(self.options)
        if opts.table and opts.pushdown:
            return VerneuilTableReader(opts, schema)
        return VerneuilReader(opts, schema)


class DatabaseGroup(InputPartition):
    """One partition: the databases one task queries, in order."""

    def __init__(self, paths: list[str]):
        super().__init__(paths)
        self.paths = paths


class VerneuilReader(DataSourceReader):
    """Runs the query (or the table's SELECT) on each database of a
    partition."""

    def __init__(self, opts: Options, schema: StructType):
        self.opts = opts
        # A schema given by the user carries `_source` / `_error` only if it
        # names them; Spark expects rows of exactly the schema's width.
        names = [f.name for f in schema.fields]
        self.with_source = SOURCE_COLUMN in names
        self.with_error = ERROR_COLUMN in names
        self.fields = [f for f in schema.fields if f.name not in (SOURCE_COLUMN, ERROR_COLUMN)]
        if names[len(self.fields):] != [n for n in (SOURCE_COLUMN, ERROR_COLUMN) if n in names]:
            raise VerneuilSourceError("%s and %s must be the last columns of the schema"
                                      % (SOURCE_COLUMN, ERROR_COLUMN))
        odd = [f for f in self.fields if not isinstance(f.dataType, SUPPORTED_TYPES)]
        if odd:
            raise VerneuilSourceError("unsupported type in the schema: %s (use %s)" % (
                ", ".join("%s %s" % (f.name, f.dataType.simpleString()) for f in odd),
                ", ".join(t.typeName() for t in SUPPORTED_TYPES)))
        self.schema = schema
        self.where: list[tuple[str, list]] = []  # pushed filters, as SQL
        self.declared: dict[str, str] | None = None
        if opts.table:
            self.declared = self._declared_types()

    def _declared_types(self) -> dict[str, str]:
        """The table's declared types in the first database that has it
        (checked against every database as it is read)."""
        for path in self.opts.paths[:INFER_DATABASES]:
            try:
                con = connect_readonly(path, self.opts.immutable)
                try:
                    declared = dict(table_columns(con, self.opts.table))
                finally:
                    con.close()
            except sqlite3.Error:
                continue
            missing = [f.name for f in self.fields if f.name not in declared]
            if missing:
                raise VerneuilSourceError("table %s in %s has no column %s"
                                          % (self.opts.table, path, ", ".join(missing)))
            return {f.name: declared[f.name] for f in self.fields}
        raise VerneuilSourceError("none of the first %d databases has a table %s"
                                  % (INFER_DATABASES, self.opts.table))

    def sql(self) -> tuple[str, list]:
        """The statement run on each database, and its parameters."""
        if not self.opts.table:
            return self.opts.query, []
        sql = "SELECT %s FROM %s" % (", ".join(quote(f.name) for f in self.fields) or "NULL",
                                     quote(self.opts.table))
        if self.where:
            sql += " WHERE " + " AND ".join("(%s)" % w for w, _ in self.where)
        return sql, [p for _, ps in self.where for p in ps]

    def partitions(self) -> list[DatabaseGroup]:
        if self.opts.partitions is not None:
            groups = balance(self.opts.paths, self.opts.partitions)
        else:
            groups = plan_by_bytes(self.opts.paths, self.opts.partition_bytes,
                                   self.opts.min_partitions)
        return [DatabaseGroup(g) for g in groups]

    def read(self, partition: DatabaseGroup) -> Iterator:
        one = self._batches if self.opts.arrow else self._tuples
        for path in partition.paths:
            try:
                out = one(path)
            except (sqlite3.Error, ConversionError) as e:
                why = explain_failure(path, e)
                if self.opts.on_error == "fail":
                    raise DatabaseError("query failed on %s: %s" % (path, why)) from None
                log.warning("skipping %s: %s", path, why)
                if self.opts.on_error == "report" and self.with_error:
                    yield self._error_row(path, why)
                continue
            yield from out

    def _tail(self, path: str, error: str | None = None) -> list:
        return ([path] if self.with_source else []) + ([error] if self.with_error else [])

    def _error_row(self, path: str, error: str):
        row = [None] * len(self.fields) + self._tail(path, error)
        if not self.opts.arrow:
            return tuple(row)
        import pyarrow as pa
        schema = arrow_schema(self.schema)
        return pa.RecordBatch.from_arrays([pa.array([v], type=t.type) for v, t in zip(row, schema)],
                                          schema=schema)

    def _cursor(self, con: sqlite3.Connection, path: str) -> sqlite3.Cursor:
        """The statement's cursor on `path`, its shape checked: a table
        whose columns differ from the schema's is that database's error."""
        if self.declared is not None:
            here = dict(table_columns(con, self.opts.table))
            differ = [n for n, d in self.declared.items()
                      if n not in here or spark_type_of(here[n]) != spark_type_of(d)]
            if differ:
                raise sqlite3.OperationalError(
                    "table %s has other columns here (%s): %s" % (self.opts.table, ", ".join(
                        "%s %s" % (n, here.get(n, "missing")) for n in differ), _HINT_DECLARED))
        sql, params = self.sql()
        cur = con.execute(sql, params)
        width = len(cur.description or ())
        # A table read of `_source` alone selects one NULL column, unused.
        expected = len(self.fields) if self.fields or not self.opts.table else 1
        if width != expected:
            raise sqlite3.OperationalError(
                "query returns %d columns, schema has %d" % (width, len(self.fields)))
        return cur

    def _column_error(self, name: str, e: ConversionError, dtype) -> ConversionError:
        hint = _HINT_DECLARED if self.opts.table else _HINT_INFERRED
        return ConversionError("column %s: %s for type %s (%s)" % (name, e, dtype.simpleString(), hint))

    def _tuples(self, path: str) -> list[tuple]:
        """Every row of `path` as tuples, converted value by value."""
        con = connect_readonly(path, self.opts.immutable)
        try:
            cur = self._cursor(con, path)
            fields = [(f.name, f.dataType) for f in self.fields]
            tail = self._tail(path)
            rows = []
            for row in cur:
                out = []
                for v, (name, dtype) in zip(row, fields):
                    try:
                        out.append(convert(v, dtype))
                    except ConversionError as e:
                        raise self._column_error(name, e, dtype) from None
                rows.append(tuple(out + tail))
            return rows
        finally:
            con.close()

    def _batches(self, path: str) -> list:
        """Every row of `path` as Arrow record batches. Text is decoded by
        sqlite3 in C; a database with text that is not UTF-8 is read again
        with replacement characters."""
        try:
            return self._read_batches(path, lenient_text=False)
        except sqlite3.OperationalError as e:
            if not is_decode_error(e):
                raise
            return self._read_batches(path, lenient_text=True)

    def _read_batches(self, path: str, lenient_text: bool) -> list:
        import pyarrow as pa
        schema = arrow_schema(self.schema)
        builders = [ColumnBuilder(f.dataType, schema.field(i).type) for i, f in enumerate(self.fields)]
        con = connect_readonly(path, self.opts.immutable, lenient_text=lenient_text)
        try:
            cur = self._cursor(con, path)
            batches = []
            while True:
                rows = cur.fetchmany(BATCH_ROWS)
                if not rows:
                    return batches
                columns = list(zip(*rows))
                arrays = []
                for f, b, values in zip(self.fields, builders, columns):
                    try:
                        arrays.append(b.build(values))
                    except ConversionError as e:
                        raise self._column_error(f.name, e, f.dataType) from None
                if self.with_source:
                    arrays.append(pa.repeat(pa.scalar(path, pa.string()), len(rows)))
                if self.with_error:
                    arrays.append(pa.nulls(len(rows), pa.string()))
                batches.append(pa.RecordBatch.from_arrays(arrays, schema=schema))
        finally:
            con.close()


class VerneuilTableReader(VerneuilReader):
    """Table mode with filter pushdown: the filters SQLite evaluates exactly
    as Spark would become the SELECT's WHERE clause; Spark applies the rest.
    (PySpark calls pushFilters only with spark.sql.python.filterPushdown.enabled,
    which `spark_session` sets; option pushdown=false reads without it.)"""

    def pushFilters(self, filters: list[Filter]) -> Iterator[Filter]:
        kinds = {f.name: compare_kind(self.declared[f.name], f.dataType) for f in self.fields}
        for f in filters:
            sql = to_sql(f, kinds)
            if sql is None:
                yield f
            else:
                log.debug("pushed %s as %s", describe(f), sql[0])
                self.where.append(sql)
