"""The fetcher's manifests, for the catalog and the past states: listings,
manifest blobs (bounded by ``max_db_size``: TooLarge, counted, without
reading it), conditional reads for the follow loop, versions, and decodes,
each a blocking call of `store.Reads` run in a worker thread behind the
fetcher's limiters for metadata (`fetcher.META_THREADS`,
`fetcher.CHECK_THREADS`).

Tested by tests/test_reader_catalog.py (test_manifests_read_on_lookup_and_parked_past_the_bound,
test_bad_manifest_is_skipped, test_base_chunk_manifest) and tests/test_history.py.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import trio

from verneuil_fuse.format import Fprint
from verneuil_fuse.store import TooLarge
from verneuil_fuse.store.retry import retry

T = TypeVar("T")


class ManifestSource:
    """The manifest side of `fetcher.Fetcher` (see the module's docstring):
    it uses the fetcher's ``reads``, ``stats``, limiters and retry schedule."""

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (store listing, manifest GET) in a worker thread.
        Cancelling abandons the call (it only reads; its result is dropped),
        so that Ctrl-C, SIGTERM or umount do not wait for a slow store."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.meta_limiter, abandon_on_cancel=True)

    async def list_manifests(self) -> list:
        self.stats["lists"] += 1
        return await self.run_blocking(self.reads.names)

    async def get_manifest_blob(self, key: str) -> bytes:
        """A manifest blob, bounded by ``max_db_size`` (else TooLarge,
        without reading it)."""
        self.stats["manifest_gets"] += 1
        with self._counting_too_large():
            return await self.run_blocking(self.reads.manifest_blob, key)

    async def get_manifest_if_changed(self, key: str, tag: str | None):
        """`Backend.get_if_changed` of a manifest (a `Tagged` blob, or None
        while the key holds the version `tag` names), bounded as
        `get_manifest_blob`, in a thread behind `CHECK_THREADS`."""
        with self._counting_too_large():
            return await trio.to_thread.run_sync(self.reads.manifest_if_changed, key, tag,
                                                 limiter=self.check_limiter, abandon_on_cancel=True)

    async def manifest_versions(self, key: str) -> list:
        """The versions of manifest ``key`` (`VersionInfo`), oldest first."""
        return await self.run_blocking(self.reads.versions, key)

    async def get_manifest_version(self, key: str, version_id: str) -> bytes:
        """One version of a manifest blob, bounded as `get_manifest_blob`."""
        self.stats["manifest_gets"] += 1
        with self._counting_too_large():
            return await self.run_blocking(self.reads.manifest_blob, key, version_id)

    @contextlib.contextmanager
    def _counting_too_large(self) -> Iterator[None]:
        try:
            yield
        except TooLarge:
            self.stats["too_large"] += 1
            raise

    async def decode_manifest(self, blob: bytes):
        """``decode_and_validate`` in a thread, bounded by ``max_db_size``; a
        base chunk is read once per decode, not cached, a few attempts."""

        def base(fp: Fprint) -> bytes:
            return retry(lambda: self.reads.base_chunk(fp), backoff=self._retry_schedule(), what="store request")

        return await self.run_blocking(self.reads.decode, blob, base)
