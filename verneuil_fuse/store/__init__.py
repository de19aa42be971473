"""Blob stores: where chunks and manifests live (S3 or a local directory).

This package owns every access to blob storage; boto3 is imported only here
(in `s3`, and only once an S3 store is opened).

- `open_store(spec) -> Store`: open a store from a URL (``file:///dir``,
  ``/dir``, ``s3://CHUNK_BUCKET?manifest_bucket=M&endpoint=...&region=...&addressing=path|domain``),
  ``@config.json``, a JSON string, a Verneuil-shaped dict, or ``None`` for the
  ``VERNEUIL_CONFIG`` environment variable.  Syntax: `config` module docstring.
- `parse_config(spec) -> dict`: the same spec as a Verneuil-shaped config dict,
  for modules that need other keys (``replication_spooling_dir``, ...).
- `read_chunk(backend, source, fp)` / `read_run`: one verified read of a
  chunk (or of a run of adjacent chunks of a pack) where
  `format.chunk_source` says it is, in either layout (`chunkread`).
- `Store` (``chunks``, ``manifests``, ``url``, ``layout``), the `Backend` protocol,
  `ObjectInfo`, `VersionInfo`, `Tagged`, and the errors: `StoreError` > `NotFound`,
  `BucketNotFound`, `AccessDenied`, `TransientError`, `TooLarge`,
  `InvalidKey`, `ConfigError`.
- Implementations: `LocalBackend` (here) and `S3Backend` / `make_client`
  (``verneuil_fuse.store.s3``, imported lazily on attribute access).
"""
from __future__ import annotations

from typing import Any

from .base import (
    MAX_KEY_BYTES,
    AccessDenied,
    Backend,
    BucketNotFound,
    ConfigError,
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
from .chunkread import read_chunk, read_run
from .config import ENV_VAR, LAYOUT_CHUNKS, LAYOUT_PACKED, LAYOUTS, open_store, parse_config, store_target, target_url
from .local import LocalBackend

__all__ = [
    "ENV_VAR",
    "LAYOUTS",
    "LAYOUT_CHUNKS",
    "LAYOUT_PACKED",
    "MAX_KEY_BYTES",
    "AccessDenied",
    "Backend",
    "BucketNotFound",
    "ConfigError",
    "InvalidKey",
    "LocalBackend",
    "NotFound",
    "ObjectInfo",
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
    "read_chunk",
    "read_run",
    "parse_config",
    "store_target",
    "target_url",
]


def __getattr__(name: str) -> Any:
    # S3Backend / make_client without importing boto3 for directory-only users.
    if name in ("S3Backend", "make_client"):
        from . import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
