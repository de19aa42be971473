"""The two programs: `verneuilctl` (this package's `main`: replicate,
inspect and restore SQLite databases) and `verneuil` (`cli.mount`: mount a
store's replicas, with its options in `cli.mount_options`).

Subcommands (each has --help):

  fingerprint    UMASH fingerprint / 64-bit hash / chunk names of a file
  manifest-name  the manifest blob name of a database path
  sqlite-extension  the path of the writer's loadable SQLite extension
  copier         run a copier daemon: spool -> store, until SIGTERM/SIGINT
  flush          upload everything pending in a spool, once; exit 0 when done
  sync           force a snapshot of databases through the VFS, then flush
  restore        rebuild a database file from the store, every chunk verified
  versions       every stored version of a database, with times; restore --at
  ls             replicated databases in a store
  manifest       decode one manifest
  lag            how far each database in a spool is behind
  repair         upload again, from the source files, chunks a store has lost
  convert        rewrite databases in the other store layout (packed / chunks)
  query          one SQL query over many databases (a mount, a glob) with Spark

Common flags mean the same everywhere: --store (URL, path, @config.json or
JSON; default VERNEUIL_CONFIG), --spool (default: the configuration's
replication_spooling_dir), --hostname, -s/--source-path, -m/--manifest,
-o/--out.  Errors print one line on stderr and exit non-zero.

The package, one module per area: parser (the command line), common (what
the commands share: store, spool, manifest, output), tools (fingerprint,
manifest-name, sqlite-extension), copier_cmds (copier, flush, sync, lag),
store_cmds (ls, manifest, restore), history_cmds (versions, restore --at),
repair_cmds (repair), convert_cmds (convert), query (query, with Spark); this module runs one
command: main() parses, sets up logging and turns every error into one line
on stderr and an exit code (verneuil_fuse/errors.py). The mount: mount (the
program: checks, logging, the layers it serves from, daemonising, signals)
and mount_options (the table of its options, the parser, --help and the
docs' table).
"""
from __future__ import annotations

import logging
import sys
from typing import Optional

from verneuil_fuse.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import print_error
from verneuil_fuse.cli.parser import build_parser, relative_at
from verneuil_fuse.cli.repair_cmds import EXIT_REPAIRABLE, EXIT_UNREPAIRABLE

__all__ = ["EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_REPAIRABLE", "EXIT_UNREPAIRABLE",
           "EXIT_USAGE", "UserError", "build_parser", "main"]


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.ERROR if quiet else (
        logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    from verneuil_fuse.logs import formatter
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter("verneuilctl", sys.stderr))
    logging.basicConfig(level=level, handlers=[handler])
    # botocore's debug output holds request headers (the access key id, a
    # session token): never below INFO, however verbose.
    for name in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(name).setLevel(max(level, logging.INFO))


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(relative_at(sys.argv[1:] if argv is None else argv))
    if args.command is None:  # `verneuilctl` alone: the commands, as --help lists them
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.verbose += args.verbose0
    args.quiet = args.quiet or args.quiet0
    if args.command == "copier":
        # A daemon: its start, the databases it replicates and its stop are
        # what an operator reads in its log, so INFO is its default.
        args.verbose = max(args.verbose, 1)
    _setup_logging(args.verbose, args.quiet)
    from verneuil_fuse.copier import NotASpool, Stopped
    from verneuil_fuse.format import BadName, ChunkError, ManifestError
    from verneuil_fuse.store import ConfigError, ReadError, StoreError
    try:
        return args.func(args)
    except UserError as e:
        print_error(str(e))
        return e.exit_code
    except ConfigError as e:
        print_error(str(e))
        return EXIT_USAGE
    except NotASpool as e:
        print_error(str(e))
        return EXIT_USAGE
    except (StoreError, ReadError, ManifestError, ChunkError, BadName, TimeoutError) as e:
        print_error(str(e))
        return EXIT_ERROR
    except Stopped:
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        try:
            sys.stdout.close()
        except OSError:
            pass
        return EXIT_ERROR
    except OSError as e:
        print_error("%s%s" % (e.strerror or e, ": %s" % e.filename if e.filename else ""))
        return EXIT_ERROR
