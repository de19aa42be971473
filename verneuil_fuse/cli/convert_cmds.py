"""`convert`: a database's current version, or every database of a store,
rewritten in the other store layout (`copier.convert`): to `packed` (packs
of many chunks, read by range) or back to `chunks` (Verneuil's layout, so a
Verneuil reader can be given the store again).  Resumable: run it again
after an interruption and it goes on where it stopped; a progress line per
database while it runs, one result line each when done."""
from __future__ import annotations

from verneuil_fuse.errors import EXIT_ERROR, EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import PhaseProgress, fmt_size, manifest_key, print_error, store_from_args


def _convert_targets(args, store) -> list[str]:
    """The manifest names to convert: -m / -s, or every one with --all."""
    named = bool(args.manifest or args.source_path)
    if args.all == named:
        raise UserError("name one database (-s PATH [--hostname H] or -m NAME) or give --all", EXIT_USAGE)
    if not args.all:
        return [manifest_key(args)]
    return sorted(info.key for info in store.manifests.list(""))


def cmd_convert(args) -> int:
    from verneuil_fuse.copier.convert import DEFAULT_WORKERS, convert_database
    from verneuil_fuse.store import ReadError
    workers = DEFAULT_WORKERS if args.workers is None else args.workers
    if workers < 1:
        raise UserError("--workers must be at least 1", EXIT_USAGE)
    store = store_from_args(args, read_only=True)
    failed = 0
    try:
        names = _convert_targets(args, store)
        if not names:
            print("no replicated databases in %s" % store.manifests.describe())
        for k, name in enumerate(names, 1):
            label = "%d/%d %s" % (k, len(names), name) if len(names) > 1 else name
            progress = PhaseProgress(label, not args.quiet)
            try:
                r = convert_database(store, name, args.to, workers=workers, progress=progress)
            except ReadError as e:
                progress.finish()
                print_error("%s: %s" % (name, e))
                failed += 1
                continue
            progress.finish()
            if not r.converted:
                print("%s: already in the %s layout" % (name, r.layout))
            else:
                print("%s: converted to the %s layout: %d chunks, %d objects written (%s), %d already there"
                      % (name, r.layout, r.chunks, r.written, fmt_size(r.bytes_written), r.skipped))
    finally:
        store.close()
    return EXIT_ERROR if failed else EXIT_OK
