"""cffi build script for verneuil_fuse.reader._chunk_engine: the reader's
chunk path in C (csrc/reader/chunk_engine.c) with UMASH (csrc/umash.c),
linked with the system's libcurl, libzstd and zlib.

cffi's API mode releases the GIL around every C call; the engine's own
thread never takes it.
"""
import os
import re

from cffi import FFI

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CSRC = os.path.join(_ROOT, "csrc")
_READER = os.path.join(_CSRC, "reader")  # the reader's C, apart from the writer's


def header_cdef(path: str) -> str:
    """The header's declarations as cffi's cdef reads them, so that they
    are written once: without its preprocessor lines (but for integer
    #defines), and with the arrays sized by a macro left to the compiler
    (``[...]``, API mode)."""
    with open(path) as f:
        lines = [line for line in f.read().splitlines()
                 if not line.startswith("#") or re.match(r"#define \w+ \d+\s*(/\*.*)?$", line)]
    return re.sub(r"\[VN_CE_\w+\]", "[...]", "\n".join(lines))


ffibuilder = FFI()
ffibuilder.cdef(header_cdef(os.path.join(_READER, "chunk_engine.h")))
ffibuilder.set_source(
    "verneuil_fuse.reader._chunk_engine",
    '#include "chunk_engine.h"',
    sources=[os.path.relpath(path, _ROOT) for path in (os.path.join(_READER, "chunk_engine.c"),
                                                        os.path.join(_CSRC, "umash.c"))],
    include_dirs=[_READER, _CSRC],
    libraries=["curl", "zstd", "z", "pthread"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
