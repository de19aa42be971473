"""Build hooks that pyproject.toml cannot express: the cffi modules.

- verneuil_fuse.format._umash: UMASH (csrc/umash.c) for Python.
- verneuil_fuse.reader._chunk_engine: the reader's chunk GETs in C
  (csrc/chunk_engine.c, with libcurl, libzstd and zlib).
- writer_vfs._vfs: the VFS (csrc/) linked with the system libsqlite3, for
  Python's sqlite3 module.
- writer_vfs/libverneuil_vfs: the same C built as a SQLite loadable extension.
"""
from setuptools import Extension, setup

# The verneuil VFS as a SQLite loadable extension (`.load` in the sqlite3
# shell): no -lsqlite3, every SQLite call goes through sqlite3_api; only the
# entry points are exported.
_VFS_SOURCES = ["csrc/vfs.c", "csrc/config.c", "csrc/log.c", "csrc/tracker.c", "csrc/spool.c",
                "csrc/names.c", "csrc/manifest_pb.c", "csrc/btree_tops.c", "csrc/umash.c",
                "csrc/wal.c", "csrc/walrec.c"]
_LOADABLE_VFS = Extension(
    "writer_vfs.libverneuil_vfs",
    sources=_VFS_SOURCES,
    include_dirs=["csrc"],
    define_macros=[("VN_LOADABLE_EXTENSION", "1")],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden"],
)

setup(
    cffi_modules=[
        "verneuil_fuse/format/_umash_build.py:ffibuilder",
        "verneuil_fuse/reader/_chunk_engine_build.py:ffibuilder",
        "writer_vfs/_vfs_build.py:ffibuilder",
    ],
    ext_modules=[_LOADABLE_VFS],
)
