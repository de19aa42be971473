"""S3 blob store: `S3Backend` (one bucket, optionally under a key prefix) and
`make_client` (the one boto3 client a store shares between its backends).

This module is the only place in the project that imports boto3/botocore.  It
owns:
- the cheap path for object GETs and PUTs: `curl.CurlEngine` (libcurl's
  multi interface: many requests in flight on one thread, a tenth of a boto3
  call's CPU), with the URL botocore builds for the bucket (addressing style,
  endpoint, region), the credentials botocore's chain gives the client at
  each request, and libcurl's own SigV4 signing (in C: Python signing cost
  more than the rest of the request); `direct_gets` gives the same URLs and
  signing to the reader's chunk engine (reader/chunk_engine.py), which GETs
  chunks in C without a thread or a Python call per request;
- the cheap path for listings: ListObjectsV2 pages through the same engine,
  URL and signing, read by `listing.parse_list_page` (about a tenth of
  botocore's CPU per key), with boto3 serving any page the engine cannot
  (no engine path, a region redirect, an answer the parser cannot read as
  botocore would).  Versions, HEADs, conditional PUTs, bucket creation
  and everything else go through boto3;
- the client configuration: connection pool size, timeouts, retry policy,
  endpoint, region, path or virtual-host ("domain") addressing; credentials
  always come from boto3's default chain (environment, ~/.aws, instance or
  container roles; the caller may name a profile and a credentials file for
  it), never from the store configuration, and are kept, refreshed and
  re-read off the callers' threads, with a time limit, by the client's
  `credentials.CredentialKeeper` (boto3's requests and the engines' signing
  alike); an access-denied answer tells the keeper;
- the translation of every botocore failure into the `StoreError` hierarchy
  of `base.py` (no botocore exception escapes a `Backend` call), with messages
  that name bucket, key and endpoint but never credentials.

Keys passed to an `S3Backend` are flat blob names (`base.check_key`); the
backend prepends its `prefix` ("" for Verneuil's layout, where keys sit at the
root of the chunk and manifest buckets) and strips it from listings.
"""
from __future__ import annotations

import errno
import functools
import logging
import re
import threading
import urllib.parse
import weakref
from typing import Any, Callable, Iterator

import boto3
import botocore
import botocore.credentials
import botocore.exceptions
import botocore.session
from botocore.config import Config

from verneuil_fuse.store.credentials import REFRESH_TIMEOUT, CredentialKeeper, CredentialsUnavailable
from verneuil_fuse.store.curl import BodyTooLarge, CurlEngine, Request, Response
from verneuil_fuse.store.retry import Backoff, retry
from verneuil_fuse.store.listing import ListingFormatError, list_query, parse_list_page

from verneuil_fuse.store.base import (
    AccessDenied,
    BucketNotFound,
    Capabilities,
    ConfigError,
    DirectGets,
    InvalidKey,
    NotFound,
    ObjectInfo,
    StoreError,
    Throttled,
    TimedOut,
    Tagged,
    TransientError,
    VersionInfo,
    check_key,
    check_max_bytes,
    check_prefix,
    check_range,
    too_large,
)

logger = logging.getLogger(__name__)

# Size of the client's HTTP connection pool.  The fetcher issues many GETs in
# parallel (trio threads behind a CapacityLimiter, plus prefetch) through the
# ONE client a store shares; with a pool smaller than the number of threads,
# urllib3 discards surplus connections after each request ("Connection pool is
# full") and every fetch pays a new TCP (+TLS) handshake.  64 covers the
# fetcher's concurrency with headroom; keep it >= any limiter in front of it.
MAX_POOL_CONNECTIONS = 64

# Seconds to establish a TCP connection.  A reachable endpoint answers in
# milliseconds; 3 s still absorbs two lost SYNs (1 s retransmit each) while an
# unreachable one fails fast enough for a FUSE read to report an error.
CONNECT_TIMEOUT = 3.0

# Seconds of silence tolerated while waiting for response bytes (per socket
# read, not for the whole transfer).  S3's first-byte latency is well under a
# second even when loaded; 15 s leaves room for slow servers without letting a
# dead connection hang a reader for minutes.
READ_TIMEOUT = 15.0

# Total attempts per request, first included, in botocore's "standard" retry
# mode (jittered exponential backoff, retries on 5xx/throttling/connection
# errors).  Small on purpose: callers (copier, fetcher) run their own retry
# loops with longer backoff, and stacked retries multiply outage latency.
MAX_ATTEMPTS = 3

# Objects GET/PUT through the engine are signed without hashing the body,
# as botocore does over HTTPS by default: the reader verifies every chunk's
# fingerprint, and TLS protects the bytes in transit.
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
# Attempts of one synchronous engine request (`get`, `put`) for a transient
# failure, first included, when the client's configuration names none: as
# botocore's standard mode does for the boto3 path, so callers see the same
# behaviour whichever path served them.
ENGINE_ATTEMPTS = MAX_ATTEMPTS
# Longest time of one engine request, in seconds, when the caller gives none:
# the connect timeout plus enough for a manifest of a 64 GiB database (18
# MiB) at a slow 2 MB/s.
ENGINE_REQUEST_TIMEOUT = 15.0
ENGINE_LARGE_REQUEST_TIMEOUT = 120.0
# A body above this size gets the long timeout: manifests, not chunks.
ENGINE_LARGE_BODY = 1 << 20

# Keys per ListObjectsV2 / ListObjectVersions page.  1000 is S3's maximum, so
# the fewest round trips; tests pass a tiny value to exercise pagination.
LIST_PAGE_SIZE = 1000
# Longest time of one listing page through the engine, in seconds: a page is
# at most a few MB, but a server may take seconds to gather it from a large
# bucket (moto walks the whole bucket per page); the client's read timeout
# still ends a silent one sooner.
LIST_REQUEST_TIMEOUT = 120.0

# Addressing styles botocore understands: "path" (http://host/bucket/key),
# "virtual" (http://bucket.host/key, Verneuil's domain_addressing=true) and
# "auto" (virtual when the bucket name allows it; IP endpoints always use
# path style).
ADDRESSING_STYLES = ("path", "virtual", "auto")

# Regions where CreateBucket must NOT send a LocationConstraint.
DEFAULT_REGIONS = frozenset({"", "us-east-1", "aws-global"})

# Error codes (or HTTP status codes botocore reports as codes, e.g. for HEAD
# requests, which carry no error body) and what they mean to callers.
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchVersion", "NotFound", "404"})
BUCKET_NOT_FOUND_CODES = frozenset({"NoSuchBucket"})
DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "Forbidden",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidSecurity",
        "NotSignedUp",
        "InvalidClientTokenId",
    }
)
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412"})
# A conditional GET (If-None-Match) whose object still has that ETag.
NOT_MODIFIED_CODES = frozenset({"NotModified", "304"})
TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        # 409: another conditional write to the same key is in flight.
        "ConditionalRequestConflict",
        "429",
    }
)
RANGE_NOT_SATISFIABLE_CODES = frozenset({"InvalidRange", "416"})
# Of the transient codes, those that ask for fewer requests (S3's guidance:
# back off and lower the request rate): `Throttled`.
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                            "TooManyRequests", "ServiceUnavailable", "429", "503"})

# Longest server-supplied error message quoted in our messages (they are
# one-liners in logs and CLI output).
MAX_QUOTED_MESSAGE = 200

# Failures of the transport (not of S3): all worth a retry.
_TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,  # refused, connect timeout, DNS, TLS, proxy
    botocore.exceptions.HTTPClientError,  # read timeout, connection closed, streaming
    botocore.exceptions.IncompleteReadError,
    OSError,  # raw socket / urllib3 errors while reading a body
)
_TIMEOUT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
)
_CREDENTIAL_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
)


# The engine path's pieces: a key marking where keys go in an object URL, an
# error answer's code and message, the codes of a bucket in another region,
# and the pause before a synchronous engine request's next attempt.
_URL_MARKER = "verneuil-url-marker"
# Keys whose URL form only needs "%" escaped (chunk and manifest names).
_PLAIN_KEY = re.compile(r"\A[A-Za-z0-9._%-]+\Z")
_XML_CODE = re.compile(rb"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(rb"<Message>([^<]{0,400})</Message>")
_REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
# The engine's synchronous requests (`get`, `put` of one object) retry a
# transient failure after 50 ms, then 100 ms, 200 ms ... (botocore's own
# retries wait about as long), without jitter: few callers wait at once.
ENGINE_RETRY_BACKOFF = 0.05
# ... never more than botocore's longest wait between attempts (20 s).
ENGINE_RETRY_CAP = 20.0


def _answer_of(err: StoreError) -> tuple[str, Any]:
    """The S3 error code and HTTP status of the answer behind ``err``
    (("", None) when it was no S3 answer)."""
    cause = err.__cause__
    if not isinstance(cause, botocore.exceptions.ClientError):
        return "", None
    return (str(cause.response.get("Error", {}).get("Code", "")),
            cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


class _Redirected:
    """An engine answer that boto3 must serve instead."""


# Each client's credential keeper (`make_client`), for its backends.
_KEEPERS: "weakref.WeakKeyDictionary[Any, CredentialKeeper]" = weakref.WeakKeyDictionary()


class _KeptCredentials(botocore.credentials.Credentials):
    """What boto3's signer of a client asks for credentials: its keeper's
    (a worker thread may wait for a refresh under way, at most its time
    limit)."""

    method = "verneuil-keeper"

    def __init__(self, keeper: CredentialKeeper):
        self._keeper = keeper

    def get_frozen_credentials(self):
        return self._keeper.frozen(wait=REFRESH_TIMEOUT)

    # What botocore reads of a Credentials object besides the frozen triple.
    access_key = property(lambda self: self.get_frozen_credentials().access_key)
    secret_key = property(lambda self: self.get_frozen_credentials().secret_key)
    token = property(lambda self: self.get_frozen_credentials().token)


def safe_endpoint(endpoint: str | None) -> str | None:
    """`endpoint` without user info, query or fragment, fit for messages."""
    if not endpoint:
        return None
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None else f"{host}:{port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def make_client(
    *,
    endpoint: str | None = None,
    region: str | None = None,
    addressing: str = "auto",
    max_attempts: int = MAX_ATTEMPTS,
    connect_timeout: float = CONNECT_TIMEOUT,
    read_timeout: float = READ_TIMEOUT,
    max_pool_connections: int = MAX_POOL_CONNECTIONS,
    profile: str | None = None,
    credentials_file: str | None = None,
) -> Any:
    """A new S3 client (its own boto3 Session, since sessions are not
    thread-safe; the client itself is).  Bad settings raise `ConfigError`.

    `profile` names a profile of the shared credentials/config files (as
    AWS_PROFILE would); `credentials_file` replaces the shared credentials
    file (as AWS_SHARED_CREDENTIALS_FILE would) for this client only.  Both
    still go through boto3's own credential chain."""
    if addressing not in ADDRESSING_STYLES:
        raise ConfigError(
            f"S3 addressing must be one of {', '.join(ADDRESSING_STYLES)}, not {addressing!r}"
        )
    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        max_pool_connections=max_pool_connections,
        s3={"addressing_style": addressing},
        # Checksums only where S3 requires them: S3-compatible servers (minio,
        # Ceph, older releases) reject botocore's default trailing checksums,
        # and readers verify every chunk's fingerprint anyway.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        core = botocore.session.Session()
        if credentials_file:
            core.set_config_variable("credentials_file", credentials_file)
        session = boto3.session.Session(botocore_session=core, profile_name=profile or None)
        # Before the client resolves its credentials: a credential_process
        # run from now on has the keeper's time limit.
        keeper = CredentialKeeper(core, "s3 at %s" % (safe_endpoint(endpoint) or "AWS"))
        client = session.client(
            "s3", endpoint_url=endpoint or None, region_name=region or None, config=config
        )
        _keep_credentials(client, keeper)
        return client
    except botocore.exceptions.ProfileNotFound:
        where = f" ({credentials_file} and the AWS config file)" if credentials_file else ""
        raise ConfigError(f"AWS profile {profile!r} not found{where}") from None
    except (ValueError, TimeoutError, botocore.exceptions.BotoCoreError) as err:
        # ValueError: botocore's "Invalid endpoint" (it quotes the endpoint,
        # which could hold user info, so say it ourselves).
        raise ConfigError(
            f"cannot configure S3 client (endpoint {safe_endpoint(endpoint)}, "
            f"region {region}): {type(err).__name__}"
        ) from None


def _keep_credentials(client: Any, keeper: CredentialKeeper) -> None:
    """The client's requests are signed with what ``keeper`` serves,
    starting from the credentials it was made with (none for an unsigned
    client, which the keeper then leaves alone)."""
    signer = getattr(client, "_request_signer", None)
    current = getattr(signer, "_credentials", None)
    if current is None:
        return
    keeper.adopt(current)
    signer._credentials = _KeptCredentials(keeper)
    _KEEPERS[client] = keeper


# S3Backend must be one class: it is the `Backend` protocol on one bucket,
# and each of its methods is one kind of request sent either through boto3
# or on the HTTP engine (`curl.CurlEngine`), sharing the client, the engine,
# the credentials' keeper, the bucket's region and prefix, and the mapping
# of S3's answers to StoreErrors; what does not depend on those is apart
# already (`curl`, `credentials`, `listing`, `retry`).
class S3Backend:
    """One S3 bucket (under an optional key prefix) as a `Backend`.

    `client` comes from `make_client` and may be shared (thread-safe).
    `create_bucket_on_demand`: when a write finds the bucket missing, create it
    (with versioning if `versioned`) and retry once, like Verneuil's
    `create_buckets_on_demand`.
    """

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        page_size: int = LIST_PAGE_SIZE,
        create_bucket_on_demand: bool = False,
        versioned: bool = False,
        endpoint: str | None = None,
        use_engine: bool = True,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"invalid S3 bucket name {bucket!r}")
        self.client = client
        self.bucket = bucket
        self.prefix = prefix
        self.page_size = page_size
        self.create_bucket_on_demand = create_bucket_on_demand
        self.versioned = versioned
        self.endpoint = safe_endpoint(endpoint)
        self.region = getattr(getattr(client, "meta", None), "region_name", None)
        # Set once the bucket is known to exist, so that a 404 on HEAD (which
        # cannot tell "no key" from "no bucket") costs a HeadBucket only once.
        self._bucket_confirmed = False
        # The engine path (see the module's docstring): off when asked, when
        # the client cannot sign, or once the bucket redirects to a region.
        self.use_engine = use_engine
        self._engine: CurlEngine | None = None
        self._url_prefix: str | None = None
        self._engine_lock = threading.Lock()
        self.credentials = _KEEPERS.get(client)  # None: an unsigned (or foreign) client

    # -- helpers ---------------------------------------------------------

    def identity(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}"
        details = [f"at {self.endpoint}"] if self.endpoint else []
        if self.region:
            details.append(f"region {self.region}")
        return f"{where} ({', '.join(details)})" if details else where

    def __repr__(self) -> str:
        return f"S3Backend({self.describe()!r})"

    def capabilities(self) -> Capabilities:
        """Direct GETs (the reader's chunk engine) and PUTs on the HTTP
        engine, both where the engine path is on (else each call says so:
        `direct_gets` None, `put_async` False); the credentials' keeper for
        the stats, when `make_client` made the client."""
        return Capabilities(direct=self, async_puts=self, credentials=self.credentials)

    def close(self) -> None:
        """Close the (possibly shared) client's connections and this
        backend's engine; idempotent."""
        with self._engine_lock:
            engine, self._engine = self._engine, None
            self.use_engine = False
        if engine is not None:
            engine.close()
        self.client.close()

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _where(self, key: str | None) -> str:
        where = f"s3://{self.bucket}/{self.prefix}{key or ''}"
        return f"{where} at {self.endpoint}" if self.endpoint else where

    def _error(self, exc: BaseException, op: str, key: str | None) -> StoreError:
        """Translate any exception from boto3 into a StoreError."""
        where = self._where(key)
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, botocore.exceptions.ClientError):
            error = exc.response.get("Error", {}) or {}
            code = str(error.get("Code", "") or "")
            status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
            message = str(error.get("Message", "") or "")
            return self._answer_error(op, key, code, status, message)
        if isinstance(exc, _CREDENTIAL_EXCEPTIONS):
            return AccessDenied(
                f"{op} {where}: no usable AWS credentials "
                f"(boto3's default chain: environment, ~/.aws, instance role)",
                key=key,
            )
        if isinstance(exc, _TIMEOUT_EXCEPTIONS):
            return TimedOut(f"{op} {where}: no answer from S3 in time ({type(exc).__name__})", key=key)
        if isinstance(exc, _TRANSIENT_EXCEPTIONS):
            return TransientError(
                f"{op} {where}: cannot reach S3 ({type(exc).__name__})", key=key
            )
        return StoreError(f"{op} {where}: {type(exc).__name__}: {exc}", key=key)

    def _answer_error(self, op: str, key: str | None, code: str, status: Any, message: str) -> StoreError:
        """The StoreError for an S3 error answer (its code and HTTP status)."""
        where = self._where(key)
        message = message[:MAX_QUOTED_MESSAGE]
        if code in DENIED_CODES or status == 403:
            if self.credentials is not None:
                self.credentials.denied()  # a rotated key: read the chain again
            # No server message: some echo request details.
            return AccessDenied(f"{op} {where}: access denied ({code or status})", key=key)
        detail = f"{code or status}" + (f" ({message})" if message else "")
        if code in BUCKET_NOT_FOUND_CODES:
            return BucketNotFound(f"{op} {where}: bucket {self.bucket} does not exist", key=key)
        if code in NOT_FOUND_CODES or status == 404:
            return NotFound(f"{op} {where}: not found ({detail})", key=key)
        if code in THROTTLE_CODES or status in (429, 503):
            return Throttled(f"{op} {where}: {detail}", key=key)
        if code in TRANSIENT_CODES or (isinstance(status, int) and status >= 500):
            return TransientError(f"{op} {where}: {detail}", key=key)
        return StoreError(f"{op} {where}: {detail}", key=key)

    def _call(self, op: str, key: str | None, method: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return method(Bucket=self.bucket, **kwargs)
        except Exception as exc:
            raise self._error(exc, op, key) from exc

    def _read_body(
        self,
        op: str,
        key: str,
        response: dict[str, Any],
        max_bytes: int | None = None,
        read_at_most: int | None = None,
    ) -> bytes:
        """The response's body.  `max_bytes`: TooLarge, before reading, when
        Content-Length says more; otherwise at most max_bytes + 1 bytes are
        read (TooLarge if that many came).  `read_at_most`: read no more
        than that many bytes and return them (a range).  Closing the body
        early drops the connection instead of draining the rest."""
        body = response["Body"]
        length = response.get("ContentLength")
        try:
            if max_bytes is not None:
                if isinstance(length, int) and length > max_bytes:
                    raise too_large(op, self._where(key), key, length, max_bytes)
                data = body.read(max_bytes + 1)
                if len(data) > max_bytes:
                    raise too_large(op, self._where(key), key, None, max_bytes)
                self._check_complete(op, key, data, length)
                return data
            if read_at_most is not None:
                data = body.read(read_at_most)
                if isinstance(length, int):
                    self._check_complete(op, key, data, min(length, read_at_most))
                return data
            return body.read()
        except StoreError:
            raise
        except Exception as exc:
            raise self._error(exc, op, key) from exc
        finally:
            body.close()

    def _check_complete(self, op: str, key: str, data: bytes, expected: int | None) -> None:
        """A bounded read does not check Content-Length itself: a body cut
        short is a TransientError, as botocore reports it for whole reads."""
        if isinstance(expected, int) and len(data) < expected:
            raise TransientError(
                f"{op} {self._where(key)}: body ended after {len(data)} of {expected} bytes",
                key=key,
            )

    def _check_bucket(self, op: str, key: str | None) -> None:
        """Raise BucketNotFound if the bucket is missing (checked at most once
        successfully per backend)."""
        if self._bucket_confirmed:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError as exc:
            error = self._error(exc, op, key)
            if isinstance(error, NotFound):
                raise BucketNotFound(
                    f"{op} {self._where(key)}: bucket {self.bucket} does not exist", key=key
                ) from exc
            raise error from exc
        except Exception as exc:
            raise self._error(exc, op, key) from exc
        self._bucket_confirmed = True

    def _head(self, op: str, key: str) -> dict[str, Any] | None:
        """HeadObject; None if the key does not exist (bucket checked)."""
        try:
            return self._call(op, key, self.client.head_object, Key=self._full(key))
        except NotFound:
            self._check_bucket(op, key)
            return None

    def _create_bucket(self) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        if (self.region or "") not in DEFAULT_REGIONS:
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        logger.info("creating missing bucket %s (versioned=%s)", self.bucket, self.versioned)
        try:
            self.client.create_bucket(**kwargs)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error(exc, "create bucket", None) from exc
        except Exception as exc:
            raise self._error(exc, "create bucket", None) from exc
        if self.versioned:
            self._call(
                "enable versioning on",
                None,
                self.client.put_bucket_versioning,
                VersioningConfiguration={"Status": "Enabled"},
            )

    def _write(self, op: str, key: str, method: Callable[..., Any], **kwargs: Any) -> Any:
        """A write, creating the bucket on demand if so configured."""
        try:
            return self._call(op, key, method, **kwargs)
        except BucketNotFound:
            if not self.create_bucket_on_demand:
                raise
        self._create_bucket()
        return self._call(op, key, method, **kwargs)

    # -- the engine path (store/curl.py) ---------------------------------

    def _engine_prefix(self) -> str | None:
        """The URL of the bucket's objects up to the key, as botocore builds
        it (addressing style, endpoint, region), or None: no engine path."""
        with self._engine_lock:
            if self._url_prefix is None and self.use_engine:
                version = self.client.meta.config.signature_version
                if version not in (None, "s3v4", "v4", botocore.UNSIGNED):
                    self.use_engine = False  # libcurl signs SigV4 only
                    return None
                try:
                    url = self.client.generate_presigned_url(
                        "get_object", Params={"Bucket": self.bucket, "Key": _URL_MARKER}, ExpiresIn=60)
                    self._url_prefix = url.split("?", 1)[0].rsplit(_URL_MARKER, 1)[0]
                    self._engine = CurlEngine()
                except CredentialsUnavailable:
                    raise  # for now: the engine path stays, tried again at the next request
                except Exception as exc:  # noqa: BLE001 - boto3 serves instead, with its own error
                    logger.debug("%s: no engine path (%s)", self.describe(), exc)
                    self.use_engine = False
            return self._url_prefix if self.use_engine else None

    def _engine_off(self, why: str) -> None:
        if self.use_engine:
            self.use_engine = False
            logger.warning("%s: %s; object GETs and PUTs go through boto3 from now on", self.describe(), why)

    def _engine_request(self, method: str, key: str, body: bytes | None, max_bytes: int | None,
                        timeout: float | None) -> Request | None:
        """The request for `key`, with what libcurl needs to sign it (SigV4,
        the credentials botocore's chain gives the client now), or None: no
        engine path."""
        auth = self._engine_auth()
        return None if auth is None else self._engine_build(auth, method, key, body, max_bytes, timeout)

    def _engine_auth(self, wait: float = REFRESH_TIMEOUT) -> tuple[str, list[str], tuple[str, str, str] | None] | None:
        """What every engine request needs now: the URL prefix, the headers
        and the SigV4 spec with the credentials the client's keeper serves
        at this moment (waiting at most ``wait`` seconds for a refresh under
        way; `CredentialsUnavailable` when there are none: the engine path
        stays); None: no engine path (or a client without a keeper and no
        credentials: boto3 then says so in its own words)."""
        prefix = self._engine_prefix()
        if prefix is None:
            return None
        headers = ["x-amz-content-sha256: " + UNSIGNED_PAYLOAD]
        sigv4 = None
        config = self.client.meta.config
        if config.signature_version is not botocore.UNSIGNED:
            if self.credentials is not None:
                frozen = self.credentials.frozen(wait)
            else:
                frozen = self._foreign_credentials()
            if frozen is None or not frozen.access_key:
                return None  # boto3 says "no credentials"
            sigv4 = ("aws:amz:%s:s3" % (self.region or "us-east-1"), frozen.access_key, frozen.secret_key)
            if frozen.token:
                headers.append("x-amz-security-token: " + frozen.token)
        return prefix, headers, sigv4

    def _foreign_credentials(self) -> Any:
        """The credentials of a client `make_client` did not make (no
        keeper): botocore's own, as it gives them; None when it cannot."""
        try:
            credentials = self.client._request_signer._credentials
            return credentials.get_frozen_credentials() if credentials is not None else None
        except Exception as exc:  # noqa: BLE001 - boto3 reports it in its own words
            logger.debug("%s: no credentials for the engine (%s)", self.describe(), exc)
            return None

    def _engine_build(self, auth: tuple[str, list[str], tuple[str, str, str] | None], method: str, key: str,
                      body: bytes | None, max_bytes: int | None, timeout: float | None) -> Request:
        prefix, headers, sigv4 = auth
        size = len(body) if body is not None else max_bytes or 0
        if timeout is None:
            timeout = ENGINE_LARGE_REQUEST_TIMEOUT if size > ENGINE_LARGE_BODY else ENGINE_REQUEST_TIMEOUT
        config = self.client.meta.config
        return Request(method, self._engine_url(prefix, key), headers, body=body, max_bytes=max_bytes, sigv4=sigv4,
                       connect_timeout=config.connect_timeout or CONNECT_TIMEOUT,
                       idle_timeout=config.read_timeout or READ_TIMEOUT, timeout=timeout)

    def _engine_url(self, prefix: str, key: str) -> str:
        full = self._full(key)
        return prefix + (full.replace("%", "%25") if _PLAIN_KEY.match(full)
                         else urllib.parse.quote(full, safe="/~"))

    def direct_gets(self) -> DirectGets | None:
        """What a GET engine of the caller's (the reader's chunk path in C,
        reader/chunk_engine.py) needs to GET this backend's objects now: their
        URLs, the headers, libcurl's SigV4 spec with the credentials
        botocore's chain gives the client at this moment, the time limits;
        None: no engine path (then `get`, in a thread). Never waits (the
        caller's is trio's thread): `CredentialsUnavailable` while the
        credentials are being refreshed or could not be, the path staying."""
        auth = self._engine_auth(wait=0.0)
        if auth is None:
            return None
        prefix, headers, sigv4 = auth
        config = self.client.meta.config
        return DirectGets(functools.partial(self._engine_url, prefix), headers, sigv4,
                          config.connect_timeout or CONNECT_TIMEOUT, config.read_timeout or READ_TIMEOUT)

    def direct_get_error(self, key: str, failure: Response | OSError, max_bytes: int) -> StoreError | None:
        """The StoreError a failed GET of a `direct_gets` engine means (a
        non-2xx answer, or no answer); None: the bucket answers from another
        region, the engine path is off from now on (`get` serves it)."""
        answer = self._engine_answer("get", key, failure, max_bytes)
        if isinstance(answer, _Redirected):
            return None
        assert isinstance(answer, StoreError), "a 2xx answer is not a failure"
        return answer

    def _engine_answer(self, op: str, key: str, result: Response | OSError,
                       max_bytes: int | None) -> bytes | StoreError:
        """The body of a 2xx answer, or the StoreError `result` means."""
        where = self._where(key)
        if isinstance(result, OSError):
            if isinstance(result, BodyTooLarge) and max_bytes is not None:
                return too_large(op, where, key, result.size, max_bytes)
            kind = TimedOut if result.errno == errno.ETIMEDOUT else TransientError
            return kind(f"{op} {where}: cannot reach S3 ({result.strerror or result})", key=key)
        if 200 <= result.status < 300:
            return result.body
        match = _XML_CODE.search(result.body[:4096])
        code = match.group(1).decode("ascii", "replace") if match else ""
        match = _XML_MESSAGE.search(result.body[:4096])
        message = match.group(1).decode("utf-8", "replace") if match else ""
        if result.status in (301, 307) or code in _REGION_CODES:
            # Another region than the client's: boto3 follows such redirects.
            self._engine_off("the bucket answers from another region (%s)" % (code or result.status))
            return _Redirected()
        return self._answer_error(op, key, code, result.status, message)

    def _engine_sync(self, op: str, method: str, key: str, body: bytes | None,
                     max_bytes: int | None) -> bytes | None:
        """One engine request and its answer, waited for here, with
        attempts for transient failures as the client's retry configuration
        says (botocore's total_max_attempts); None: use boto3."""

        def once() -> bytes | None:
            request = self._engine_request(method, key, body, max_bytes, None)
            result = None if request is None else self._engine_roundtrip(request)
            if result is None:
                return None
            answer = self._engine_answer(op, key, result, max_bytes)
            if isinstance(answer, _Redirected):
                return None
            if isinstance(answer, StoreError):
                raise answer
            return answer

        return retry(once, backoff=self._engine_backoff(), what="%s %s" % (op, key))

    def _engine_backoff(self) -> Backoff:
        """The waits between a synchronous engine request's attempts, as
        many as the client's retry configuration says (botocore's
        total_max_attempts)."""
        retries = self.client.meta.config.retries or {}
        attempts = max(1, int(retries.get("total_max_attempts", ENGINE_ATTEMPTS)))
        return Backoff(base=ENGINE_RETRY_BACKOFF, cap=ENGINE_RETRY_CAP, attempts=attempts, jitter=False)

    def _engine_roundtrip(self, request: Request) -> Response | OSError | None:
        """Send `request` on the engine and wait for its answer; None: the
        engine took no request (closed)."""
        box: list = []
        ready = threading.Event()

        def finish(result: Response | OSError) -> None:
            box.append(result)
            ready.set()

        try:
            self._engine.submit(request, finish)
        except OSError:
            return None
        ready.wait()
        return box[0]

    def _engine_conditional(self, key: str, tag: str | None, max_bytes: int | None) -> Tagged | None | _Redirected:
        """`get_if_changed` on the engine: a GET with If-None-Match, whose
        304 answer is "unchanged"; `_Redirected`: no engine path (boto3
        serves it), as for an answer without an ETag."""

        def once() -> Tagged | None | _Redirected:
            auth = self._engine_auth()
            if auth is None:
                return _Redirected()
            prefix, headers, sigv4 = auth
            condition = ["If-None-Match: " + tag] if tag else []
            request = self._engine_build((prefix, headers + condition, sigv4), "GET", key, None, max_bytes, None)
            result = self._engine_roundtrip(request)
            if result is None:
                return _Redirected()
            if isinstance(result, Response) and result.status == 304:
                return None
            answer = self._engine_answer("get", key, result, max_bytes)
            if isinstance(answer, StoreError):
                raise answer
            if isinstance(answer, _Redirected) or not result.etag:
                return _Redirected()
            return Tagged(answer, result.etag)

        return retry(once, backoff=self._engine_backoff(), what="conditional get %s" % key)

    # -- Backend ---------------------------------------------------------

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes)
        data = self._engine_sync("get", "GET", key, None, max_bytes)
        return data if data is not None else self._get_boto3(key, max_bytes)

    def _get_boto3(self, key: str, max_bytes: int | None) -> bytes:
        response = self._call("get", key, self.client.get_object, Key=self._full(key))
        return self._read_body("get", key, response, max_bytes)

    def get_if_changed(self, key: str, tag: str | None, max_bytes: int | None = None) -> Tagged | None:
        check_max_bytes(max_bytes)
        answer = self._engine_conditional(key, tag, max_bytes)
        if not isinstance(answer, _Redirected):
            return answer
        kwargs: dict[str, Any] = {"Key": self._full(key)}
        if tag:
            kwargs["IfNoneMatch"] = tag
        try:
            response = self._call("get", key, self.client.get_object, **kwargs)
        except StoreError as err:
            code, status = _answer_of(err)
            if code in NOT_MODIFIED_CODES or status == 304:
                return None
            raise
        data = self._read_body("get", key, response, max_bytes)
        return Tagged(data, str(response.get("ETag") or ""))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        full = self._full(key)
        check_range(start, end)
        if start == end:
            if self._head("get range of", key) is None:
                raise NotFound(f"get range of {self._where(key)}: not found", key=key)
            return b""
        try:
            response = self._call(
                "get range of", key, self.client.get_object, Key=full, Range=f"bytes={start}-{end - 1}"
            )
        except StoreError as err:
            cause = err.__cause__
            if isinstance(cause, botocore.exceptions.ClientError):
                code = str(cause.response.get("Error", {}).get("Code", ""))
                if code in RANGE_NOT_SATISFIABLE_CODES:
                    return b""  # the range starts at or past the end
            raise
        # A server ignoring Range would answer 200 with the whole object:
        # read only as far as `end` of it, never the rest.
        data = self._read_body("get range of", key, response, read_at_most=end)
        if response.get("ContentRange") is None and len(data) > end - start:
            data = data[start:end]
        return data

    def put(self, key: str, data: bytes) -> None:
        try:
            sent = self._engine_sync("put", "PUT", key, bytes(data), None) is not None
        except BucketNotFound:
            if not self.create_bucket_on_demand:
                raise
            sent = False  # boto3's path creates it
        if not sent:
            self._write("put", key, self.client.put_object, Key=self._full(key), Body=data)
        logger.debug("put %s (%d bytes)", self._where(key), len(data))

    def put_async(self, key: str, data: bytes, done: Callable[[StoreError | None], None]) -> bool:
        """Start a PUT of `key` on the engine; `done` gets None once it is
        stored, or the StoreError, on the engine's thread (keep it short;
        a bucket that answers from another region is an error here: `put`
        serves it through boto3). False, and nothing started, when the
        engine path is not available, or no credentials now (then call
        `put`, which retries and says why)."""
        try:
            auth = self._engine_auth()
        except CredentialsUnavailable:
            return False
        if auth is None:
            return False
        request = self._engine_build(auth, "PUT", key, bytes(data), None, None)

        def finish(result: Response | OSError) -> None:
            answer = self._engine_answer("put", key, result, None)
            if isinstance(answer, _Redirected):
                answer = TransientError(f"put {self._where(key)}: the bucket answers from another region", key=key)
            done(answer if isinstance(answer, StoreError) else None)

        try:
            self._engine.submit(request, finish)
        except OSError:
            return False
        return True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._full(key)
        try:
            self._write("put", key, self.client.put_object, Key=full, Body=data, IfNoneMatch="*")
        except StoreError as err:
            code, status = _answer_of(err)
            if code in PRECONDITION_CODES or status == 412:
                return False
            raise
        logger.debug("put_if_absent %s (%d bytes)", self._where(key), len(data))
        return True

    def exists(self, key: str) -> bool:
        return self._head("check", key) is not None

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Key=self._full(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        return self._list(prefix)

    # Whether listings try the engine first; cleared for good on a backend
    # whose server answers a listing the parser cannot read as botocore would.
    _engine_lists = True

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        """The keys under `prefix`, a page at a time: from the engine when it
        can serve the page (`_list_page_engine`), else from boto3 (the
        continuation token of either serves the other)."""
        strip = len(self.prefix)
        full_prefix = self.prefix + prefix
        token: str | None = None
        while True:
            page = self._list_page_engine(full_prefix, token) if self._engine_lists else None
            entries, token = page if page is not None else self._list_page_boto3(full_prefix, token)
            for full, size, mtime in entries:
                key = full[strip:]
                try:
                    check_key(key)
                except InvalidKey:
                    logger.debug("list %s: skipping foreign key %r", self.describe(), full)
                    continue
                yield ObjectInfo(key, size, mtime)
            if token is None:
                return

    def _list_page_boto3(self, full_prefix: str,
                         token: str | None) -> tuple[list[tuple[str, int, float]], str | None]:
        """One ListObjectsV2 page through boto3: ``(key, size, mtime)`` per
        entry, and the next page's continuation token (None: the last)."""
        kwargs: dict[str, Any] = {
            "Prefix": full_prefix,
            "MaxKeys": self.page_size,
            # Keys with a further "/" belong to someone else (or to the other
            # half of a single-bucket store); S3 folds them into CommonPrefixes.
            "Delimiter": "/",
        }
        if token is not None:
            kwargs["ContinuationToken"] = token
        page = self._call("list", None, self.client.list_objects_v2, **kwargs)
        entries = [(item["Key"], int(item.get("Size", 0)), item["LastModified"].timestamp())
                   for item in page.get("Contents", ())]
        token = page.get("NextContinuationToken")
        return entries, (token if page.get("IsTruncated") and token else None)

    def _list_page_engine(self, full_prefix: str,
                          token: str | None) -> tuple[list[tuple[str, int, float]], str | None] | None:
        """`_list_page_boto3` through the engine (the same query, delimiter
        "/" included, keys URL-encoded), with attempts for transient failures
        as `_engine_sync` makes them; None: boto3 must serve this page."""
        retries = self.client.meta.config.retries or {}
        attempts = max(1, int(retries.get("total_max_attempts", ENGINE_ATTEMPTS)))
        backoff = Backoff(base=ENGINE_RETRY_BACKOFF, cap=ENGINE_RETRY_CAP, attempts=attempts, jitter=False)
        body = retry(lambda: self._list_fetch(full_prefix, token), backoff=backoff,
                     what="list %s" % self.describe())
        if body is None:
            return None
        try:
            return parse_list_page(body)
        except ListingFormatError as exc:
            self._engine_lists = False
            logger.warning("%s: %s; listings go through boto3 from now on", self.describe(), exc)
            return None

    def _list_fetch(self, full_prefix: str, token: str | None) -> bytes | None:
        """One ListObjectsV2 request on the engine and its answer's body,
        waited for here; the StoreError of an error answer; None: no engine
        path (or a region redirect)."""
        auth = self._engine_auth()
        engine = self._engine
        if auth is None or engine is None:
            return None
        prefix, headers, sigv4 = auth
        # The bucket's URL as botocore lists it: ".../bucket" in path style,
        # "https://bucket.host/" in virtual style.
        if urllib.parse.urlsplit(prefix).path not in ("", "/"):
            prefix = prefix.rstrip("/")
        config = self.client.meta.config
        request = Request("GET", prefix + "?" + list_query(full_prefix, self.page_size, token), headers,
                          sigv4=sigv4,
                          connect_timeout=config.connect_timeout or CONNECT_TIMEOUT,
                          idle_timeout=config.read_timeout or READ_TIMEOUT, timeout=LIST_REQUEST_TIMEOUT)
        box: list = []
        ready = threading.Event()
        try:
            engine.submit(request, lambda result: (box.append(result), ready.set()))
        except OSError:
            return None
        ready.wait()
        answer = self._engine_answer("list", None, box[0], None)
        if isinstance(answer, _Redirected):
            return None
        if isinstance(answer, StoreError):
            raise answer
        return answer

    def list_versions(self, key: str) -> list[VersionInfo]:
        full = self._full(key)
        kwargs: dict[str, Any] = {"Prefix": full, "MaxKeys": self.page_size}
        versions: list[VersionInfo] = []
        while True:
            page = self._call("list versions of", key, self.client.list_object_versions, **kwargs)
            past_key = False
            for item in page.get("Versions", ()):
                if item["Key"] == full:
                    versions.append(
                        VersionInfo(
                            key,
                            str(item.get("VersionId") or "null"),
                            int(item.get("Size", 0)),
                            item["LastModified"].timestamp(),
                            bool(item.get("IsLatest")),
                        )
                    )
                elif item["Key"] > full:
                    past_key = True
            # Versions come grouped by key in key order: once a longer key
            # sharing the prefix shows up, ours is done.
            for item in page.get("DeleteMarkers", ()):
                if item["Key"] > full:
                    past_key = True
            if past_key or not page.get("IsTruncated"):
                return versions
            kwargs["KeyMarker"] = page.get("NextKeyMarker")
            kwargs["VersionIdMarker"] = page.get("NextVersionIdMarker")

    def get_version(self, key: str, version_id: str, max_bytes: int | None = None) -> bytes:
        check_max_bytes(max_bytes)
        try:
            response = self._call(
                "get version", key, self.client.get_object, Key=self._full(key), VersionId=version_id
            )
        except StoreError as err:
            cause = err.__cause__
            if isinstance(cause, botocore.exceptions.ClientError):
                code = str(cause.response.get("Error", {}).get("Code", ""))
                if code == "InvalidArgument":  # S3's answer to a malformed version id
                    raise NotFound(
                        f"get version {self._where(key)}: no version {version_id!r}", key=key
                    ) from cause
            raise
        return self._read_body("get version", key, response, max_bytes)

    def touch(self, key: str) -> None:
        full = self._full(key)
        self._call(
            "touch",
            key,
            self.client.copy_object,
            Key=full,
            CopySource={"Bucket": self.bucket, "Key": full},
            MetadataDirective="REPLACE",
        )
