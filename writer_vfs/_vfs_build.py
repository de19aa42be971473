"""cffi build script for writer_vfs._vfs: the verneuil VFS (csrc/) linked
with the system libsqlite3, so that registering it from Python makes it
visible to Python's own sqlite3 module (which uses the same libsqlite3.so.0).

The same C is also built as a SQLite loadable extension by setup.py
(writer_vfs/libverneuil_vfs*.so, VN_LOADABLE_EXTENSION).
"""
import os

from cffi import FFI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CSRC = os.path.join(_ROOT, "csrc")

# The C files of the VFS, shared with the loadable extension in setup.py.
SOURCES = ["vfs.c", "tracker.c", "spool.c", "manifest_pb.c", "btree_tops.c", "umash.c"]
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]

ffibuilder = FFI()
ffibuilder.cdef(
    """
    int verneuil_vfs_register(const char *spool_dir, int make_default);
    int verneuil_vfs_register_from_env(void);
    void verneuil_vfs_set_gc_weight(double weight);
    int verneuil_vfs_set_bundle_chunks(int n);
    void verneuil_vfs_set_log_stderr(int on);
    int verneuil_vfs_db_spool_dir(const char *spool_dir, const char *db_path,
        char *out, size_t cap);
    const char *sqlite3_libversion(void);
    """
)
ffibuilder.set_source(
    "writer_vfs._vfs",
    '#include <sqlite3.h>\n#include "verneuil_vfs.h"',
    sources=[os.path.relpath(os.path.join(_CSRC, s), _ROOT) for s in SOURCES],
    include_dirs=[_CSRC],
    libraries=["sqlite3"],
    extra_compile_args=CFLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
