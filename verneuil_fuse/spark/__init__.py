"""A PySpark data source that reads many SQLite files as one DataFrame.

    spark.dataSource.register(VerneuilDataSource)     # or spark_session()
    df = (spark.read.format("verneuil")
          .option("table", "events")                  # or option("query", "SELECT ...")
          .load("/mnt/replicas/web1/data/tenants")    # a directory, a glob,
          .where("kind = 'k1' AND v > 10"))           # or option("paths", json list)

Two modes. `table`: the schema comes from the table's declared columns
(INTEGER as long, REAL as double, TEXT as string, BLOB as binary,
BOOLEAN, DATE, DATETIME/TIMESTAMP, DECIMAL(p,s) by name), each database's
table is checked against it, and the filters SQLite evaluates exactly as
Spark would (comparisons, IN, IS [NOT] NULL, NOT, prefix/suffix/substring,
on plain columns) run in SQLite (`df.explain()` lists them under
PushedFilters); option `columns` reads only some columns (PySpark's Python
data sources get no column pruning from Spark: unselected columns are read,
then dropped). `query`: any read-only SQL, its schema given with
`.schema(...)` or inferred from its first rows on a few databases, types
widened over them.

Each row carries the database it came from (column `_source`; add
`_source STRING` and, with on_error=report, `_error STRING` as the last
columns of a given schema). A value its column's type cannot hold exactly
(a REAL in a long column) is an error of that database, never a silent
cast. Rows leave the readers as Arrow record batches (option arrow=false:
tuples, converted value by value, the same values).

Databases are grouped into partitions by size (partition_bytes, default
512 MiB, each database counted with an open cost of 1 MiB, at least
min_partitions groups, default the driver host's cores): many small
databases share a task, a large one has its own. Files are opened
read-only, `immutable=1` by default (an open handle on the mount pins one
snapshot), or `mode=ro` with option immutable=false for files that may
change.

A database a task cannot read (a host without the mount, a damaged file)
is named with the executor host and why (`explain_failure`): on_error=fail
ends the job with that one line (`DatabaseError`; `spark_session` hides the
Python traceback), skip logs it on the executor, report puts it in
`_error`, and `without_errors(df)` of a report read prints on the driver
how many databases failed and why, then drops those rows.

Options: query or table (one of them), columns (table mode), paths (JSON
list, or load's path), on_error = fail (default) | skip (log and drop that
database) | report (one row with `_error` set and the other columns null),
immutable, infer_rows (query mode: rows used to infer types, default 100),
partition_bytes (e.g. 64m), min_partitions, partitions (an exact count,
balanced by size), arrow (true), pushdown (true; table mode).
"""
from verneuil_fuse.spark.convert import SUPPORTED_TYPES, ConversionError
from verneuil_fuse.spark.files import (DB_SUFFIXES, DatabaseError, VerneuilSourceError, balance,
                                       connect_readonly, explain_failure, find_databases, plan_by_bytes)
from verneuil_fuse.spark.options import ON_ERROR, OPTIONS
from verneuil_fuse.spark.query import check_output, explain, run_query, without_errors
from verneuil_fuse.spark.schema import ERROR_COLUMN, SOURCE_COLUMN, infer_schema, table_schema
from verneuil_fuse.spark.session import spark_session
from verneuil_fuse.spark.source import DatabaseGroup, VerneuilDataSource, VerneuilReader, VerneuilTableReader

__all__ = [
    "ConversionError", "DB_SUFFIXES", "DatabaseError", "DatabaseGroup", "ERROR_COLUMN", "ON_ERROR", "OPTIONS",
    "SOURCE_COLUMN", "SUPPORTED_TYPES", "VerneuilDataSource", "VerneuilReader",
    "VerneuilSourceError", "VerneuilTableReader", "balance", "check_output", "connect_readonly",
    "explain", "explain_failure", "find_databases", "infer_schema", "plan_by_bytes", "run_query",
    "spark_session", "table_schema", "without_errors",
]
