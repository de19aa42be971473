"""Blob stores: where chunks and manifests live (S3 or a local directory).

This package owns every access to blob storage; boto3 is imported only here
(in `s3`, and only once an S3 store is opened).

- `open_store(spec) -> Store`: open a store from a URL (``file:///dir``,
  ``/dir``, ``s3://CHUNK_BUCKET?manifest_bucket=M&endpoint=...&region=...&addressing=path|domain``),
  ``@config.json``, a JSON string, a Verneuil-shaped dict, or ``None`` for the
  ``VERNEUIL_CONFIG`` environment variable.  Syntax: `config` module docstring.
- `parse_config(spec) -> dict`: the same spec as a Verneuil-shaped config dict,
  for modules that need other keys (``replication_spooling_dir``, ...).
- `Reads(store, max_db_size=...)`: the one verified, bounded read of a
  store's manifests and chunks, in either layout, every reader's; its
  failures for people as `ReadError`; `ChunkReads`, the part of it the
  reader's flights use (`reads`).
- `Store` (``chunks``, ``manifests``, ``url``, ``layout``), the `Backend` protocol
  and the `Capabilities` a backend may have (`DirectReads` with its
  `DirectGets`, `AsyncPuts`, `CredentialsView`), `ObjectInfo`, `VersionInfo`,
  `Tagged`, and the errors: `StoreError` > `NotFound`,
  `BucketNotFound`, `AccessDenied`, `TransientError`, `TooLarge`,
  `InvalidKey`, `ConfigError`.
- Implementations: `LocalBackend` (here) and `S3Backend` / `make_client`
  (``verneuil_fuse.store.s3``, imported lazily on attribute access).
"""
from __future__ import annotations

from typing import Any

from verneuil_fuse.store.base import (
    MAX_KEY_BYTES,
    NO_CAPABILITIES,
    AccessDenied,
    AsyncPuts,
    Backend,
    BucketNotFound,
    Capabilities,
    ConfigError,
    CredentialsView,
    DirectGets,
    DirectReads,
    InvalidKey,
    NotFound,
    ObjectInfo,
    Store,
    StoreError,
    Throttled,
    TimedOut,
    Tagged,
    TooLarge,
    TransientError,
    VersionInfo,
    check_key,
)
from verneuil_fuse.store.config import ENV_VAR, LAYOUT_CHUNKS, LAYOUT_PACKED, LAYOUTS, open_store, parse_config, store_target, target_url
from verneuil_fuse.store.local import LocalBackend
from verneuil_fuse.store.reads import ChunkReads, ReadError, Reads

__all__ = [
    "ENV_VAR",
    "LAYOUTS",
    "LAYOUT_CHUNKS",
    "LAYOUT_PACKED",
    "MAX_KEY_BYTES",
    "NO_CAPABILITIES",
    "AccessDenied",
    "AsyncPuts",
    "Backend",
    "BucketNotFound",
    "Capabilities",
    "ChunkReads",
    "ConfigError",
    "CredentialsView",
    "DirectGets",
    "DirectReads",
    "InvalidKey",
    "LocalBackend",
    "NotFound",
    "ObjectInfo",
    "ReadError",
    "Reads",
    "S3Backend",
    "Store",
    "StoreError",
    "Throttled",
    "TimedOut",
    "Tagged",
    "TooLarge",
    "TransientError",
    "VersionInfo",
    "check_key",
    "open_store",
    "parse_config",
    "store_target",
    "target_url",
]


def __getattr__(name: str) -> Any:
    # S3Backend / make_client without importing boto3 for directory-only users.
    if name == "S3Backend":
        from verneuil_fuse.store.s3 import S3Backend

        return S3Backend
    if name == "make_client":
        from verneuil_fuse.store.s3 import make_client

        return make_client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
