"""cffi build script for verneuil_fuse.reader._chunk_engine: the reader's
chunk path in C (csrc/chunk_engine.c) with UMASH (csrc/umash.c), linked
with the system's libcurl, libzstd and zlib.

cffi's API mode releases the GIL around every C call; the engine's own
thread never takes it.
"""
import os

from cffi import FFI

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CSRC = os.path.join(_ROOT, "csrc")

ffibuilder = FFI()
ffibuilder.cdef(
    """
    #define VN_CE_CHUNK_SIZE 65536
    #define VN_CE_URL_MAX 2048
    enum vn_ce_result { VN_CE_CHUNK, VN_CE_HTTP, VN_CE_TRANSPORT, VN_CE_TOO_LARGE,
        VN_CE_MISMATCH, VN_CE_SHUTDOWN };
    struct vn_ce_request {
        char url[2048];
        uint64_t fp[2];
        int data_fd;
        int idx_fd;
        int64_t offset;
        int32_t timeout_ms;
        int32_t result;
        int32_t status;
        int32_t curl_code;
        int32_t write_errno;
        uint32_t body_len;
        uint32_t length;
        int64_t declared;
        unsigned char *body;
        unsigned char *chunk;
        char error[256];
    };
    struct vn_ce_engine;
    int vn_ce_open(int slots, size_t max_body, const void *chunk_key, int notify_fd,
        struct vn_ce_engine **out);
    struct vn_ce_request *vn_ce_request(struct vn_ce_engine *engine, int i);
    int vn_ce_set_auth(struct vn_ce_engine *engine, const char *headers, const char *sigv4,
        const char *userpwd, long connect_timeout_ms, long idle_timeout_s);
    int vn_ce_submit(struct vn_ce_engine *engine, const int *indices, int n);
    int vn_ce_take(struct vn_ce_engine *engine, int *out, int cap);
    void vn_ce_close(struct vn_ce_engine *engine);
    void vn_ce_free(struct vn_ce_engine *engine);
    """
)
ffibuilder.set_source(
    "verneuil_fuse.reader._chunk_engine",
    '#include "chunk_engine.h"',
    sources=[os.path.relpath(os.path.join(_CSRC, name), _ROOT) for name in ("chunk_engine.c", "umash.c")],
    include_dirs=[_CSRC],
    libraries=["curl", "zstd", "z", "pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
