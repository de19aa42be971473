"""The format tools, which need neither a store nor a spool: `fingerprint`
(the UMASH fingerprint, 64-bit hash or chunk names of a file's bytes),
`manifest-name` (the manifest blob name of a database path) and
`sqlite-extension` (the path of the writer's loadable SQLite extension)."""
from __future__ import annotations

from verneuil_fuse.errors import EXIT_OK, EXIT_USAGE, UserError
from verneuil_fuse.cli.common import read_input


def _key_bytes(key: str) -> bytes:
    from verneuil_fuse import format as fmt
    if key in fmt.KEYS:
        return fmt.KEYS[key]
    raw = key.encode("utf-8")
    if len(raw) > 32:
        raise UserError("a UMASH key is at most 32 bytes; %r has %d (or use one of: %s)"
                        % (key, len(raw), ", ".join(fmt.KEYS)), EXIT_USAGE)
    return raw


def cmd_fingerprint(args) -> int:
    from verneuil_fuse import format as fmt
    key = _key_bytes(args.key)
    data = read_input(args.file)
    if args.chunks:
        view = memoryview(data)
        for start in range(0, len(view), fmt.CHUNK_SIZE):
            piece = view[start:start + fmt.CHUNK_SIZE]
            if args.hash64:
                print("%016x" % fmt.hash64(piece, key))
            else:
                print(fmt.fingerprint(piece, key).name)
        return EXIT_OK
    if args.hash64:
        print("%016x" % fmt.hash64(data, key))
    else:
        print(fmt.fingerprint(data, key).name)
    return EXIT_OK


def cmd_manifest_name(args) -> int:
    from verneuil_fuse import format as fmt
    if not args.path:
        raise UserError("PATH is empty", EXIT_USAGE)
    try:
        print(fmt.manifest_name(args.path, args.hostname))
    except fmt.BadName as e:
        raise UserError(str(e), EXIT_USAGE) from None
    return EXIT_OK


def cmd_sqlite_extension(args) -> int:
    try:
        import writer_vfs
        print(writer_vfs.loadable_extension_path())
    except (ImportError, FileNotFoundError) as e:
        raise UserError("the SQLite extension is not built (reinstall the package): %s" % e) from None
    return EXIT_OK
