"""The benchmarks' meter: the tests' S3 proxy (tests/support/s3server.py), started
at once with a latency, and named for what the benchmarks use it for.

Every system under test (the verneuil mount, s3fs, rclone, the copier,
`verneuilctl restore`, plain boto3) reaches moto through one of these, so
their GETs and bytes are counted by the same meter and all pay the same
added round trip. See `s3server.Proxy` for what is counted: requests by
method (an object GET as "GET", a bucket GET as "LIST", a conditional GET
as "REVALIDATE": the follow loop asking whether a manifest changed), bytes
each way.
Binds 127.0.0.1 only.
"""
from __future__ import annotations

from support.s3server import Proxy


class CountingProxy(Proxy):
    """Forwards HOST:port to HOST:target_port, adding latency and counting."""

    def __init__(self, target_port: int, latency: float = 0.0) -> None:
        super().__init__(target_port, latency)
        self.start()

    def close(self) -> None:
        self.stop()
