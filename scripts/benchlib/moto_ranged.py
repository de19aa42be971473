"""moto's S3 server with ranged GETs that cost what the range costs.

Run as a program (`python moto_ranged.py -H 127.0.0.1 -p PORT`), it patches
moto and runs `moto.server.main`.  Stock moto 5 answers a ranged GET by
copying the whole object out of its buffer and then slicing it: measured
here, a 64 KiB range of a 256 MiB object took ~150-200 ms instead of ~8 ms.
That is an artefact of the emulator (S3 reads only the range), and it falls
entirely on clients that keep a database as one big object (s3fs, rclone),
never on Verneuil's 64 KiB chunk objects.  The patch changes only that: for
a GET with a `Range: bytes=A-B` header (no partNumber), the object's value
is handed to moto's own range code as a lazy view whose slice reads just
those bytes.  Everything else (headers, status codes, 416s) is moto's code.

The process also asks for SIGTERM when its parent dies (PR_SET_PDEATHSIG),
as tests/support/s3server.py does for its moto.
"""
from __future__ import annotations

import ctypes
import signal
import sys
import threading

_state = threading.local()


class _LazyValue:
    """len() is the object's size; a slice reads only its bytes."""

    def __init__(self, key) -> None:
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __bool__(self) -> bool:
        return self.key.size > 0

    def __getitem__(self, item):
        if not isinstance(item, slice) or item.step not in (None, 1):
            return self.full()[item]
        start, stop, _ = item.indices(self.key.size)
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))

    def full(self) -> bytes:
        return self.key.value_unpatched


def patch() -> None:
    from moto.s3 import models, responses

    key_cls = models.FakeKey
    original_value = key_cls.value
    key_cls.value_unpatched = property(original_value.fget)

    def value_get(self):
        if getattr(_state, "lazy", False):
            return _LazyValue(self)
        return original_value.fget(self)

    key_cls.value = property(value_get, original_value.fset)

    resp_cls = responses.S3Response
    original_get = resp_cls.get_object
    original_range = resp_cls._handle_range_header

    def get_object(self):
        rng = (self.headers.get("range") or self.headers.get("Range") or "").strip()
        simple = (rng.startswith("bytes=") and "," not in rng
                  and not self.querystring.get("partNumber"))
        _state.lazy = simple
        try:
            return original_get(self)
        finally:
            _state.lazy = False

    def handle_range(self, request, response_headers, response_content):
        status, headers, content = original_range(self, request, response_headers,
                                                  response_content)
        if isinstance(content, _LazyValue):  # moto decided to send it all
            content = content.full()
        return status, headers, content

    resp_cls.get_object = get_object
    resp_cls._handle_range_header = handle_range

    # The whole-object path (no range) must never see a lazy value: the
    # dispatcher materialises one left over by a range that was not applied.
    original_key_response = resp_cls.key_response

    def key_response(self, *args, **kwargs):
        status, headers, content = original_key_response(self, *args, **kwargs)
        if isinstance(content, _LazyValue):
            content = content.full()
        return status, headers, content

    resp_cls.key_response = key_response


def main(argv=None) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:  # noqa: BLE001 - only a safety net
        pass
    patch()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
