"""cffi build script for verneuil_fuse.format._umash (UMASH in C).

cffi's API mode releases the GIL around every C call, so hashing a long
buffer lets other Python threads run.
"""
import os

from cffi import FFI

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CSRC = os.path.join(_ROOT, "csrc")

ffibuilder = FFI()
ffibuilder.cdef(
    """
    struct vn_umash_params {
        uint64_t poly[2][2];
        uint64_t oh[34];
    };
    struct vn_umash_fp { uint64_t hash[2]; };
    void vn_umash_params_derive(struct vn_umash_params *params, uint64_t bits,
        const void *key);
    uint64_t vn_umash_full(const struct vn_umash_params *params, uint64_t seed,
        int which, const void *data, size_t n_bytes);
    struct vn_umash_fp vn_umash_fprint(const struct vn_umash_params *params,
        uint64_t seed, const void *data, size_t n_bytes);
    int vn_umash_select_impl(int impl);
    int vn_umash_active_impl(void);
    """
)
ffibuilder.set_source(
    "verneuil_fuse.format._umash",
    '#include "umash.h"',
    sources=[os.path.relpath(os.path.join(_CSRC, "umash.c"), _ROOT)],
    include_dirs=[_CSRC],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
