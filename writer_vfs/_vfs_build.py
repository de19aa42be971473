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

# The C files of the VFS, listed once in csrc/vfs_sources.txt (setup.py and
# scripts/sqlite-testsuite.sh read them there too).
with open(os.path.join(_CSRC, "vfs_sources.txt")) as _f:
    SOURCES = [line.strip() for line in _f if line.strip() and not line.startswith("#")]
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra"]

ffibuilder = FFI()
ffibuilder.cdef(
    """
    int verneuil_vfs_register(const char *spool_dir, int make_default);
    int verneuil_vfs_register_from_env(void);
    int verneuil_vfs_config_from_env(char *spool, size_t spool_cap, size_t *spool_len,
        int *make_default, int *warn_stderr, unsigned long long *max_db_size, char *why, size_t why_cap);
    unsigned long long verneuil_vfs_set_max_db_size(unsigned long long n);
    unsigned long long verneuil_vfs_max_db_size_limit(void);
    void verneuil_vfs_set_gc_weight(double weight);
    int verneuil_vfs_set_bundle_chunks(int n);
    void verneuil_vfs_set_log_stderr(int on);
    void verneuil_vfs_set_warn_stderr(int on);
    int verneuil_vfs_set_wal_async(int on);
    int verneuil_vfs_wait_staged(int timeout_ms);
    int vn_test_btree_tops(const unsigned char *data, size_t size, size_t budget,
        unsigned long long *out, size_t cap);
    int verneuil_vfs_db_spool_dir(const char *spool_dir, const char *db_path,
        char *out, size_t cap);
    const char *sqlite3_libversion(void);
    """
)
# Test hook (this module only, not the loadable extension): the b-tree tops
# walk of csrc/btree_tops.c over a file in memory, so that tests can feed it
# any bytes, including ones SQLite itself would refuse to open.  Returns the
# number of chunks chosen (their indices in out), -1 if a read failed, -2 if
# a chosen chunk's bytes are not the file's.
_TEST_HOOK = r"""
#include <stdlib.h>
#include <string.h>
#include "btree_tops.h"

struct vn_test_file { const unsigned char *data; size_t size; };

static int vn_test_read(void *ctx, uint8_t *buf, size_t len, uint64_t off)
{
    const struct vn_test_file *f = ctx;

    if (off > f->size || len > f->size - off)
        return -1;
    memcpy(buf, f->data + off, len);
    return 0;
}

int vn_test_btree_tops(const unsigned char *data, size_t size, size_t budget,
    unsigned long long *out, size_t cap)
{
    struct vn_test_file f = { data, size };
    uint8_t *bufs[VN_TOPS_MAX_CHUNKS] = { 0 };
    uint8_t *page = malloc(VN_CHUNK_SIZE);
    struct vn_tops tops;
    int rc;

    if (page == NULL)
        return -1;
    rc = vn_btree_tops(data, size < VN_CHUNK_SIZE ? size : VN_CHUNK_SIZE,
        size, budget, vn_test_read, &f, bufs, page, &tops);
    if (rc == 0) {
        rc = (int)tops.n;
        for (size_t k = 0; k < tops.n; k++) {
            uint64_t off = tops.index[k] * VN_CHUNK_SIZE;
            if (off >= size || tops.len[k] != (size - off < VN_CHUNK_SIZE ?
                size - off : VN_CHUNK_SIZE) ||
                memcmp(tops.data[k], data + off, tops.len[k]) != 0)
                rc = -2;
            if (k < cap)
                out[k] = tops.index[k];
        }
    }
    for (size_t i = 0; i < VN_TOPS_MAX_CHUNKS; i++)
        free(bufs[i]);
    free(page);
    return rc;
}
"""

ffibuilder.set_source(
    "writer_vfs._vfs",
    '#include <sqlite3.h>\n#include "verneuil_vfs.h"\n' + _TEST_HOOK,
    sources=[os.path.relpath(os.path.join(_CSRC, s), _ROOT) for s in SOURCES],
    include_dirs=[_CSRC],
    libraries=["sqlite3"],
    extra_compile_args=CFLAGS,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
