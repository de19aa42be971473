"""The blob-store contract: the `Backend` protocol, its records and its errors.

This module owns what every store implementation promises and what callers may
rely on:

- `Backend`: one synchronous interface to ONE bucket (or directory) of blobs.
  Implementations: `local.LocalBackend` (a directory) and `s3.S3Backend` (an S3
  bucket, optionally under a key prefix).  Calls block; async callers run them
  in threads.  Implementations are safe to share between threads.
- `Store`: the pair of backends a replica lives in (chunks + manifests; the two
  buckets may differ), the URL that reopens it (`open_store(store.url)`) and
  the layout copiers write it in (`layout`: "chunks" or "packed").
- `ObjectInfo` / `VersionInfo`: what listings yield; `Tagged`: a blob and
  the tag of its version, what a conditional read (`get_if_changed`) gives.
- `Capabilities`: what a backend can do beyond the calls every backend has,
  as types (`Backend.capabilities()`; a field is None when it cannot):
  `DirectReads` (objects another engine may GET itself, with the URLs and
  signing `DirectGets` describes: S3), `AsyncPuts` (PUTs started without a
  thread waiting on each: S3's HTTP engine) and `CredentialsView` (the
  state of the credentials that sign its requests, for the stats).
- The error hierarchy.  Every failure of a backend call is a `StoreError`
  (never a botocore or OSError leaking through), and no message ever holds a
  credential:

  - `NotFound`: the key (or that version of it) does not exist.
  - `BucketNotFound`: the bucket / directory itself does not exist.
  - `AccessDenied`: credentials missing, refused or not allowed to do this.
  - `TransientError`: worth retrying (5xx, SlowDown, timeouts, connection
    errors, a full or flaky local disk); callers own the retry loop.
  - `TooLarge`: the object is larger than the `max_bytes` the caller allowed
    (`get`, `get_version`); never worth a retry.
  - `InvalidKey`: a key that is not a single flat blob name (see `check_key`).
  - `ConfigError`: a store spec that cannot be understood (one-line message).

Keys are flat names: chunk names (`%016x%%2F%016x`, literally `%2F`) and
manifest names are already percent-encoded, so a valid key never holds `/`.
Both backends apply the same rules (`check_key`) so that any bucket can be
mirrored into a directory and back.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from verneuil_fuse.store.curl import Response

logger = logging.getLogger(__name__)

# Longest key accepted, in UTF-8 bytes.  255 is NAME_MAX on Linux file
# systems, so every key can also be a file name in a directory store; manifest
# names are at most 104 + 32 + 104 = 240 bytes (docs/FORMAT.md) and chunk names 35.
MAX_KEY_BYTES = 255

# Prefix of the names the local store reserves for its temporary files; keys
# may not start with it (and listings skip such names).
RESERVED_KEY_PREFIX = "."


class StoreError(Exception):
    """Base class of every error raised by a blob store.

    `key` is the blob key concerned, when there is one.  Messages name the
    location (bucket, directory, endpoint) but never credentials.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class NotFound(StoreError):
    """The key (or the requested version of it) does not exist."""


class BucketNotFound(StoreError):
    """The bucket (S3) or directory (local store) does not exist."""


class AccessDenied(StoreError):
    """Missing, invalid or insufficient credentials / permissions."""


class TransientError(StoreError):
    """A failure that may go away on retry: 5xx, throttling, timeouts, network."""


class Throttled(TransientError):
    """The store asks for fewer requests (S3's 503 SlowDown, ServiceUnavailable,
    429): a caller with many in flight sends fewer."""


class TimedOut(TransientError):
    """No answer within the request's time limit (a store overloaded, or a
    network that lost it)."""


class TooLarge(StoreError):
    """The object is larger than the caller's bound (`max_bytes`); it was not
    read.  Not transient: whoever wrote it must replace it, or the caller
    must allow more."""

    def __init__(self, message: str, *, key: str | None = None, size: int | None = None,
                 bound: int | None = None) -> None:
        super().__init__(message, key=key)
        self.size = size
        self.bound = bound


def check_max_bytes(max_bytes: int | None) -> None:
    """Validate the `max_bytes` bound given to `Backend.get`/`get_version`."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be None or an int >= 0, not {max_bytes!r}")


def too_large(op: str, where: str, key: str, size: int | None, bound: int) -> TooLarge:
    """The TooLarge error for `key` at `where`: `size` bytes (None: more than
    `bound`, learnt while reading) against a bound of `bound` bytes."""
    what = f"{size} bytes" if size is not None else f"more than {bound} bytes"
    return TooLarge(f"{op} {where}: object is {what}, larger than the {bound}-byte bound",
                    key=key, size=size, bound=bound)


class InvalidKey(StoreError, ValueError):
    """A key that is not a valid flat blob name (see `check_key`)."""


class ConfigError(StoreError, ValueError):
    """A store spec / configuration that cannot be used; the message is one line."""


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One blob in a listing: its key (without any backend prefix), size in
    bytes and modification time (seconds since the epoch)."""

    key: str
    size: int
    mtime: float


@dataclasses.dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version of a blob.  `version_id` is opaque ("null" for unversioned
    buckets and for a directory store's blobs kept without history);
    `is_latest` marks the current one."""

    key: str
    version_id: str
    size: int
    mtime: float
    is_latest: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Tagged:
    """A blob read by `Backend.get_if_changed` and the tag of the version it
    is: opaque, equal for the same stored object and different once the key
    is written again (S3: the ETag; a directory: the file's inode, size and
    mtime)."""

    data: bytes
    tag: str


def check_key(key: object) -> str:
    """Return `key` if it is a valid flat blob name, else raise `InvalidKey`.

    Refused: non-strings, the empty string, `.` and `..`, anything holding `/`
    or NUL, names longer than `MAX_KEY_BYTES` UTF-8 bytes (or not encodable),
    and names starting with `RESERVED_KEY_PREFIX` (temporary files).
    """
    if not isinstance(key, str):
        raise InvalidKey(f"blob key must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidKey("blob key must not be empty")
    if "/" in key or "\0" in key:
        raise InvalidKey(f"blob key must not contain '/' or NUL: {key!r}", key=key)
    if key.startswith(RESERVED_KEY_PREFIX):  # also covers "." and ".."
        raise InvalidKey(
            f"blob key must not start with {RESERVED_KEY_PREFIX!r} "
            f"(reserved for temporary files): {key!r}",
            key=key,
        )
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidKey(f"blob key is not valid UTF-8: {key!r}", key=key) from None
    if size > MAX_KEY_BYTES:
        raise InvalidKey(
            f"blob key is {size} bytes long, more than {MAX_KEY_BYTES}: {key[:40]!r}...",
            key=key,
        )
    return key


def check_prefix(prefix: object) -> str:
    """Return `prefix` if it can start a valid key ("" included), else raise
    `InvalidKey`."""
    if not isinstance(prefix, str):
        raise InvalidKey(f"listing prefix must be a str, not {type(prefix).__name__}")
    if "/" in prefix or "\0" in prefix:
        raise InvalidKey(f"listing prefix must not contain '/' or NUL: {prefix!r}")
    return prefix


def check_range(start: int, end: int) -> None:
    """Validate a byte range [start, end) given to `Backend.get_range`."""
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")


@dataclasses.dataclass(frozen=True)
class DirectGets:
    """What an engine of the caller's needs to GET a backend's objects
    itself (`DirectReads.direct_gets`): an object's URL (``url(key)``) and
    what every GET of it is sent with."""

    url: Callable[[str], str]
    headers: list[str]
    sigv4: tuple[str, str, str] | None  # libcurl's AWS_SIGV4 spec, access key, secret
    connect_timeout: float
    idle_timeout: float  # no byte for this long ends a GET


class DirectReads(Protocol):
    """A backend whose objects another engine may GET itself (the reader's
    chunk engine in C, reader/chunk_engine.py), without a thread or a
    Python call per request."""

    def direct_gets(self) -> Optional[DirectGets]:
        """The URLs and signing of GETs sent now; None: not now nor later
        (the engine path is off: `Backend.get` serves). Never waits: a
        StoreError while the credentials that would sign them are being
        refreshed or could not be (the path stays)."""
        ...

    def direct_get_error(self, key: str, failure: "Response | OSError", max_bytes: int) -> Optional[StoreError]:
        """The StoreError a failed direct GET means (a non-2xx answer, or
        none); None: the engine path is off from now on (`Backend.get`
        serves this GET)."""
        ...


class AsyncPuts(Protocol):
    """A backend that starts PUTs without a thread waiting on each."""

    def put_async(self, key: str, data: bytes, done: Callable[[Optional[StoreError]], None]) -> bool:
        """Start a PUT of `key`; `done` gets None once it is stored, or the
        StoreError, on another thread (keep it short). False, and nothing
        started, when it cannot now (`Backend.put` then serves it, and says
        why)."""
        ...


class CredentialsView(Protocol):
    """The credentials that sign a backend's requests, as the stats show
    them (`store.credentials.CredentialKeeper`)."""

    def describe(self) -> dict:
        ...


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond `Backend`'s calls (`Backend.capabilities`);
    a field is None when it cannot."""

    direct: Optional[DirectReads] = None
    async_puts: Optional[AsyncPuts] = None
    credentials: Optional[CredentialsView] = None


# A backend with no capability beyond `Backend`'s calls (a directory).
NO_CAPABILITIES = Capabilities()


@runtime_checkable
class Backend(Protocol):
    """One bucket (or directory) of blobs, accessed synchronously.

    All methods raise `StoreError` subclasses only (plus `ValueError` for a
    malformed byte range or bound).  Keys are checked with `check_key`.
    """

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole blob.  `NotFound` if it does not exist.

        With `max_bytes`, an object larger than that is `TooLarge`: its size is
        checked before its bytes are read (directory: fstat of the open file;
        S3: the response's Content-Length) and at most `max_bytes` + 1 bytes
        are ever read, so an object that grows or lies about its size is
        refused too.  Callers reading what anyone with write access to the
        store may have put there pass a bound."""
        ...

    def get_if_changed(self, key: str, tag: str | None, max_bytes: int | None = None) -> Tagged | None:
        """The blob and its tag, or None when the key still holds the version
        `tag` names (nothing read: S3 answers a GET with If-None-Match 304
        without a body; a directory compares the file's stat).  `tag` None:
        the blob whatever its version.  `NotFound` and `max_bytes` as for
        `get`.  What a reader that watches a few keys calls often: an
        unchanged key costs a request and no body."""
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the blob; shorter (possibly empty) when the
        range runs past the end.  `NotFound` if the blob does not exist."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Create or replace the blob atomically (readers see old or new)."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the blob unless it exists; True if this call wrote it.

        A retried request whose first attempt landed may report False: the
        blob then holds `data` anyway, which is all content-addressed callers
        need."""
        ...

    def exists(self, key: str) -> bool:
        """Whether the blob exists."""
        ...

    def delete(self, key: str) -> None:
        """Delete the blob (on a versioned bucket: add a delete marker).
        Deleting a missing key is not an error."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Current blobs whose key starts with `prefix`, fetched lazily page by
        page; errors surface while iterating.  Order is unspecified (S3 yields
        key order; a directory yields directory order)."""
        ...

    def list_versions(self, key: str) -> list[VersionInfo]:
        """Versions of one key, newest first (delete markers left out); empty if
        there are none.  A directory store lists the versions it kept (its
        manifests: `local` module docstring), else the current one alone,
        with version id "null"."""
        ...

    def get_version(self, key: str, version_id: str, max_bytes: int | None = None) -> bytes:
        """One version of a blob.  `NotFound` if that version does not exist;
        `max_bytes` as for `get` (`TooLarge`, nothing past the bound read)."""
        ...

    def touch(self, key: str) -> None:
        """Refresh the blob's modification time so lifecycle expiry restarts
        (S3: copy onto itself; directory: utime).  `NotFound` if missing."""
        ...

    def describe(self) -> str:
        """Human-readable location, e.g. `s3://bucket/prefix at http://host`.
        Never holds credentials."""
        ...

    def identity(self) -> str:
        """Where the blobs live, whatever the route to them: `s3://bucket/prefix`
        (no endpoint, region or credentials), `file:///abs/dir`. Two backends
        with one identity hold the same blobs."""
        ...

    def capabilities(self) -> Capabilities:
        """What it can do beyond these calls (`Capabilities`)."""
        ...

    def close(self) -> None:
        """Release connections and threads (idempotent)."""
        ...


@dataclasses.dataclass
class Store:
    """Where replicas live: a chunk backend and a manifest backend.

    `url` is a spec that `open_store` turns back into an equivalent store
    (pass it to subprocesses, mounts, Spark executors).  `layout` is how
    copiers write chunks ("chunks": an object each, Verneuil's layout;
    "packed": packs read by range); readers read both whatever it says.
    """

    chunks: Backend
    manifests: Backend
    url: str
    layout: str = "chunks"

    def describe(self) -> str:
        """Human-readable description of both locations (no credentials)."""
        chunks, manifests = self.chunks.describe(), self.manifests.describe()
        return f"chunks: {chunks}; manifests: {manifests}"

    def close(self) -> None:
        """Release connections (idempotent)."""
        self.chunks.close()
        if self.manifests is not self.chunks:
            self.manifests.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
