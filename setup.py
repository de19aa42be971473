"""Build hooks that pyproject.toml cannot express: the cffi modules.

- verneuil_fuse.format._umash: UMASH (csrc/umash.c) for Python.
- verneuil_fuse.reader._chunk_engine: the reader's chunk GETs in C
  (csrc/reader/chunk_engine.c, with libcurl, libzstd and zlib).
- writer_vfs._vfs: the VFS (csrc/) linked with the system libsqlite3, for
  Python's sqlite3 module.
- writer_vfs/libverneuil_vfs: the same C built as a SQLite loadable extension.
"""
import os

from setuptools import Extension, setup

# The C files of the VFS, listed once in csrc/vfs_sources.txt.
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "vfs_sources.txt")) as _f:
    _VFS_SOURCES = ["csrc/" + line.strip() for line in _f if line.strip() and not line.startswith("#")]

# The verneuil VFS as a SQLite loadable extension (`.load` in the sqlite3
# shell): no -lsqlite3, every SQLite call goes through sqlite3_api; only the
# entry points are exported.
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
