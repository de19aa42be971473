"""Build hooks that pyproject.toml cannot express: the cffi modules.

- verneuil_fuse.format._umash: UMASH (csrc/umash.c) for Python.
- writer_vfs._vfs: the VFS (csrc/) linked with the system libsqlite3, for
  Python's sqlite3 module.
- writer_vfs/libverneuil_vfs: the same C built as a SQLite loadable extension.
"""
from setuptools import setup

setup(
    cffi_modules=[
        "verneuil_fuse/format/_umash_build.py:ffibuilder",
    ],
)
