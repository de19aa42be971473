"""`repair`: for each database named (or --all of a spool), the chunks its
current manifest in the store lacks, uploaded again from the source file
where its bytes still match; a report per database, a progress line while
it runs, and the exit codes that tell repaired, repairable (--dry-run) and
unrepairable apart."""
from __future__ import annotations

import os

from verneuil_fuse.errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import PhaseProgress, log, print_error, print_json, spool_from_args, store_from_args


# `repair` exit codes besides EXIT_OK, EXIT_ERROR and EXIT_USAGE (docs/COPIER.md).
EXIT_UNREPAIRABLE = 3  # chunks are still missing: the source changed since the store's snapshot
EXIT_REPAIRABLE = 4    # --dry-run only: chunks are missing, and a real run would upload them all
# Unrepairable chunk names listed per database in the text report: enough to
# look a few up by hand without flooding a terminal (--json lists them all).
REPAIR_LISTED = 10
def _repair_targets(args) -> list[tuple[str, str]]:
    """(source path, manifest name) of each database to repair."""
    from verneuil_fuse import format as fmt
    from verneuil_fuse.copier.spool import spool_databases
    paths = list(args.db) + list(args.source_path or [])
    if args.all:
        if paths:
            raise UserError("give database files or --all, not both", EXIT_USAGE)
        targets = []
        for source, name in spool_databases(spool_from_args(args), args.hostname):
            if os.path.isfile(source):
                targets.append((source, name))
            else:
                log.warning("%s: the database file is gone, skipped", source)
        return targets
    if not paths:
        raise UserError("name the databases to repair (their files on this host), or --all "
                        "with --spool", EXIT_USAGE)
    targets = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError("%s: no such database file" % path, EXIT_USAGE)
        try:
            name = fmt.manifest_name(path if args.hostname is None else os.path.abspath(path),
                                     args.hostname)
        except fmt.BadName as e:
            raise UserError(str(e), EXIT_USAGE) from None
        targets.append((path, name))
    return targets


def _repair_advice(report) -> str:
    what = ("the base chunk of its manifest is missing (the manifest's chunk list cannot be "
            "read without it) and cannot be rebuilt" if report.base_chunk_unrepairable else
            "%d missing chunks cannot be repaired" % len(report.unrepairable))
    return ("%s: %s: the file changed since the store's snapshot of it. Publish a snapshot of "
            "the file as it is now (`verneuilctl sync %s`, or a commit through the verneuil VFS "
            "after `PRAGMA verneuil_full_snapshot`), then run `verneuilctl repair` again"
            % (report.source, what, report.source))


def cmd_repair(args) -> int:
    from verneuil_fuse.readback.repair import DEFAULT_WORKERS, NoManifest, repair_database
    from verneuil_fuse.store import ReadError
    workers = DEFAULT_WORKERS if args.workers is None else args.workers
    if workers < 1:
        raise UserError("--workers must be at least 1", EXIT_USAGE)
    targets = _repair_targets(args)
    if not targets:
        print("no databases in spool %s" % spool_from_args(args))
        return EXIT_OK
    # Read-only: never creates a directory store that is not there.
    store = store_from_args(args, read_only=True)
    reports, failed = [], []
    try:
        for source, name in targets:
            progress = PhaseProgress(source, not args.quiet)
            try:
                reports.append(repair_database(store, source, name, dry_run=args.dry_run,
                                               workers=workers, progress=progress))
            except NoManifest as e:
                failed.append((source, name, "nothing to repair: %s (was it replicated to this "
                               "store, from this host? `verneuilctl ls` lists what the store "
                               "holds)" % e))
            except ReadError as e:
                failed.append((source, name, str(e)))
            except OSError as e:
                failed.append((source, name, "cannot read it: %s" % (e.strerror or e)))
            finally:
                progress.finish()
    finally:
        store.close()
    if args.json:
        print_json([r.as_dict() for r in reports] +
                    [{"source": s, "manifest": n, "error": why} for s, n, why in failed])
    else:
        for r in reports:
            done = ("%d repairable (dry run: nothing uploaded)" % len(r.repairable)
                    if r.dry_run else "%d repaired" % len(r.repaired))
            print("%s: %d %s checked, %d missing, %s, %d unrepairable%s" % (
                r.source, r.checked, "objects (packs and chunks)" if r.packed else "chunks",
                len(r.missing), done, len(r.unrepairable),
                "" if r.dry_run or not r.complete else " (complete)"))
            for chunk in r.unrepairable[:REPAIR_LISTED]:
                print("  unrepairable: %s" % chunk)
            if len(r.unrepairable) > REPAIR_LISTED:
                print("  ... and %d more" % (len(r.unrepairable) - REPAIR_LISTED))
    for source, _name, why in failed:
        print_error("%s: %s" % (source, why))
    unrepairable = [r for r in reports if r.unrepairable]
    for r in unrepairable:
        print_error(_repair_advice(r))
    if failed:
        return EXIT_ERROR
    if unrepairable:
        return EXIT_UNREPAIRABLE
    if args.dry_run and any(r.missing for r in reports):
        return EXIT_REPAIRABLE
    return EXIT_OK
