"""`query`: one SQL query over many SQLite databases (a mount, a glob,
files) with Spark, through verneuil_fuse.spark; PySpark is imported only
when the command runs, and Spark's errors come back as one line."""
from __future__ import annotations

import logging
import os

from verneuil_fuse.errors import EXIT_OK, EXIT_USAGE, UserError


def cmd_query(args) -> int:
    try:
        from verneuil_fuse import spark
    except ImportError as e:
        raise UserError("query needs PySpark (pip install 'verneuil_fuse[spark]'): %s" % e)
    if args.verbose < 2:
        # py4j logs tracebacks through the root logger when Ctrl-C cuts a
        # call to the JVM; the interruption is reported once, by main().
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda record: "%spy4j%s" % (os.sep, os.sep) not in record.pathname)
    if args.sql is not None:
        where, sql = args.items, args.sql
    elif len(args.items) >= 2:
        where, sql = args.items[:-1], args.items[-1]
    else:
        raise UserError("query needs databases and SQL: verneuilctl query MOUNT_OR_GLOB... 'SQL' "
                        "(or --sql 'SQL')", EXIT_USAGE)
    try:
        spark.run_query(where, sql, master=args.master, output=args.output,
                        show=args.show, on_error=args.on_error, force=args.force, union=args.union)
    except spark.VerneuilSourceError as e:
        raise UserError(str(e), EXIT_USAGE) from None
    except Exception as e:  # Spark wraps worker errors in long Java traces
        why = spark.explain(e)
        raise UserError(why if why.startswith("query failed") else "query failed: %s" % why) from None
    return EXIT_OK
