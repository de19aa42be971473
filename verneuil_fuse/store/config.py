"""Store specs: from a URL, a path, JSON or a Verneuil config to a `Store`.

This module owns the syntax users write to name a store, and its translation
into backends.  Accepted specs (`parse_config` / `open_store`):

- ``None``: the value of the ``VERNEUIL_CONFIG`` environment variable, which
  may itself be any of the string forms below (Verneuil puts JSON or
  ``@/path/to/file.json`` there).
- ``file:///dir`` or a plain absolute path ``/dir``: the directory store
  ``<dir>/chunks/`` + ``<dir>/manifests/``.  Query options: ``create=false``:
  do not create missing directories (report `BucketNotFound` instead);
  ``keep_versions=N`` (default `DEFAULT_KEEP_VERSIONS`; 0: no history) and
  ``keep_days=D`` (default `DEFAULT_KEEP_DAYS`; 0: no age bound): how many
  past versions of each manifest the store keeps, and for how long after
  they stopped being current (`local` module docstring); ``layout=`` (below).
- ``s3://CHUNK_BUCKET?manifest_bucket=M&endpoint=http://127.0.0.1:9000&region=us-east-1&addressing=path``
  with these optional query parameters (unknown ones are refused):

  - ``manifest_bucket``: the (versioned) manifest bucket.  Given: Verneuil's
    layout, keys at the root of both buckets.  Omitted: ONE bucket holds both,
    chunks under ``chunks/`` and manifests under ``manifests/`` (the same
    layout as a directory store; that bucket should then be versioned).
  - ``chunk_prefix``, ``manifest_prefix``: override those key prefixes (may be
    empty; usually end with ``/``).
  - ``endpoint``: an ``http(s)://host[:port]`` S3-compatible endpoint
    (default: AWS).  No user info: credentials come from boto3's chain.
  - ``region``: signing region (default: boto3's chain, else us-east-1).
  - ``addressing``: ``path`` (``host/bucket/key``), ``domain`` or ``virtual``
    (``bucket.host/key``), or ``auto`` (default; IP endpoints use path).
  - ``create_buckets_on_demand``: ``true`` to create missing buckets on write
    (the manifest bucket with versioning).
  - ``layout``: as for ``file://`` URLs, below.

  Both schemes take ``layout=chunks`` (the default: Verneuil's layout, one
  object per chunk) or ``layout=packed`` (many chunks per object, read by
  range: docs/FORMAT.md, "Packed layout").  Only copiers (and `convert`)
  look at it: readers read either layout without being told.

  The URL path must be empty or ``/``; credentials in the URL are refused.
- ``@/path/config.json``: a JSON file; ``{...}``: a JSON string; a ``dict``.
  The JSON is Verneuil's configuration: the store is the first entry of
  ``replication_targets`` that is either Verneuil's
  ``{"s3": {"region", "endpoint", "chunk_bucket", "manifest_bucket",
  "domain_addressing", "create_buckets_on_demand"}}`` (plus this project's
  optional ``chunk_prefix`` / ``manifest_prefix``; an omitted
  ``manifest_bucket`` means one bucket, as in the URL) or this project's
  ``{"directory": {"path": "/dir", "create": true, "keep_versions": 1000,
  "keep_days": 7}}``; either target may say ``"layout": "packed"``.  ``local`` and
  ``read_only`` entries are chunk caches, not stores, and are skipped here.
  A bare target (``{"s3": {...}}`` or ``{"directory": {...}}``) is accepted
  too.

`parse_config` returns the whole configuration as a dict (URL and path specs
become ``{"replication_targets": [target]}``) so that other modules can read
other keys (``replication_spooling_dir``, ...).  `Store.url` is a canonical
URL for the store, accepted by `open_store` in another process.

This module names ``VERNEUIL_CONFIG`` (`ENV_VAR`) and is the only reader of
it on the reader and CLI side: `env_config` returns its value and
`env_config_present` tells whether it is set, for the modules above that
fall back to it (`verneuil_fuse.config`, `verneuilctl`).

Every problem raises `ConfigError` with a one-line message a CLI can print;
messages never echo credentials.
"""
from __future__ import annotations

import json
import logging
import os
import urllib.parse
from typing import Any, Mapping

from verneuil_fuse.store.base import ConfigError, Store
from verneuil_fuse.store.local import LocalBackend

# A directory store's manifest history (the S3 equivalent is the manifest
# bucket's versioning and its lifecycle rule).  1000 past versions cost about
# 1000 manifests per database (each holds its chunk 0, a few KiB compressed,
# plus 16 bytes per chunk), and 7 days covers a week of mistakes to undo; a
# database committing every second reaches the count bound first, so its
# history is its last 1000 uploads.
DEFAULT_KEEP_VERSIONS = 1000
DEFAULT_KEEP_DAYS = 7.0
SECONDS_PER_DAY = 86400.0

logger = logging.getLogger(__name__)

# Environment variable holding the configuration when the spec is None; the
# name Verneuil uses, so one variable configures both.
ENV_VAR = "VERNEUIL_CONFIG"

# Target kinds that name a store (first one wins), and the cache kinds that
# may share `replication_targets` with them but are not stores.
STORE_TARGET_KINDS = ("s3", "directory")
CACHE_TARGET_KINDS = ("local", "read_only")

# Subdirectories of a directory store, and the key prefixes of a single-bucket
# S3 store (same names, so a directory store and a bucket mirror each other).
CHUNKS_SUBDIR = "chunks"
MANIFESTS_SUBDIR = "manifests"
SINGLE_BUCKET_CHUNK_PREFIX = CHUNKS_SUBDIR + "/"
SINGLE_BUCKET_MANIFEST_PREFIX = MANIFESTS_SUBDIR + "/"

# `addressing=` values in URLs and what botocore calls them.
ADDRESSING_ALIASES = {"path": "path", "domain": "virtual", "virtual": "virtual", "auto": "auto"}

# Query parameters accepted in each URL scheme.
S3_URL_PARAMS = frozenset(
    {
        "manifest_bucket",
        "chunk_prefix",
        "manifest_prefix",
        "endpoint",
        "region",
        "addressing",
        "create_buckets_on_demand",
        "layout",
    }
)
FILE_URL_PARAMS = frozenset({"create", "keep_versions", "keep_days", "layout"})

# Store layouts (docs/FORMAT.md): Verneuil's, one object per chunk (the
# default), and this project's packs of many chunks read by range.
LAYOUT_CHUNKS = "chunks"
LAYOUT_PACKED = "packed"
LAYOUTS = (LAYOUT_CHUNKS, LAYOUT_PACKED)

# Spellings of booleans in URLs.
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})

# Longest piece of a bad spec quoted back in an error message.
MAX_QUOTED_SPEC = 80


def _urlsplit(text: str, what: str) -> urllib.parse.SplitResult:
    """urlsplit, with its ValueError (e.g. "Invalid IPv6 URL") as a ConfigError."""
    try:
        return urllib.parse.urlsplit(text)
    except ValueError as err:
        raise ConfigError(f"{what} is not a valid URL ({err}): {_quote_spec(text)}") from None


def _quote_spec(text: str) -> str:
    text = text if len(text) <= MAX_QUOTED_SPEC else text[:MAX_QUOTED_SPEC] + "..."
    return repr(text)


# -- parsing -----------------------------------------------------------------


def env_config() -> str | None:
    """The value of `ENV_VAR` as set, or None when it is unset or blank.
    The one place the reader and CLI side read that variable (the writer VFS,
    which imports nothing of this package, reads it on its own)."""
    value = os.environ.get(ENV_VAR)
    if value is None or not value.strip():
        return None
    return value


def env_config_present() -> bool:
    """Whether `ENV_VAR` holds a configuration (set and not blank): the
    default that a spec of None stands for."""
    return env_config() is not None


def parse_config(spec: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The configuration named by `spec`, as a Verneuil-shaped dict."""
    if spec is None:
        value = env_config()
        if value is None:
            raise ConfigError(
                f"no store given and {ENV_VAR} is not set "
                "(use file:///dir, s3://bucket?..., @config.json or JSON)"
            )
        return _parse(value, ENV_VAR)
    return _parse(spec, "store spec")


def _parse(spec: Any, source: str) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        return _from_mapping(spec, source)
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise ConfigError(f"{source} must be a string or a dict, not {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise ConfigError(f"{source} is empty")
    if text.startswith("@"):
        return _from_file(text[1:], source)
    if text.startswith("{"):
        return _from_json(text, source)
    scheme = text.split(":", 1)[0].lower() if ":" in text else ""
    if scheme == "file":
        return _wrap(_parse_file_url(text))
    if scheme == "s3":
        return _wrap(_parse_s3_url(text))
    if text.startswith("/"):
        return _wrap({"directory": {"path": os.path.normpath(text)}})
    raise ConfigError(
        f"{source} {_quote_spec(text)} is not a store: use file:///dir, /abs/dir, "
        "s3://bucket?..., @config.json or a JSON object"
    )


def _wrap(target: dict[str, Any]) -> dict[str, Any]:
    return {"replication_targets": [target]}


def _from_file(path: str, source: str) -> dict[str, Any]:
    path = path.strip()
    if not path:
        raise ConfigError(f"{source}: '@' must be followed by a configuration file path")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"cannot read configuration file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"configuration file {path} is not UTF-8 text") from None
    return _from_json(text, f"configuration file {path}")


def _from_json(text: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"invalid JSON in {source}: {err.msg} at line {err.lineno} column {err.colno}"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must hold a JSON object, not {type(value).__name__}")
    return _from_mapping(value, source)


def _from_mapping(value: Mapping[str, Any], source: str) -> dict[str, Any]:
    config = dict(value)
    if "replication_targets" not in config and len(config) == 1:
        (kind,) = config
        if kind in STORE_TARGET_KINDS:  # a bare target
            return _wrap(config)
    targets = config.get("replication_targets")
    if targets is not None and not isinstance(targets, list):
        raise ConfigError(f"{source}: replication_targets must be a list")
    return config


def _bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise ConfigError(f"{what} must be true or false, not {_quote_spec(str(value))}")


def _query(parts: urllib.parse.SplitResult, allowed: frozenset[str], scheme: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(
            parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)
        )
    except ValueError:
        raise ConfigError(f"malformed query string in {scheme} URL") from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            raise ConfigError(
                f"unknown {scheme} URL parameter {name!r} (known: {', '.join(sorted(allowed))})"
            )
        if name in params:
            raise ConfigError(f"{scheme} URL parameter {name!r} given twice")
        params[name] = value
    if parts.fragment:
        raise ConfigError(f"{scheme} URL must not have a #fragment")
    return params


def _parse_file_url(text: str) -> dict[str, Any]:
    parts = _urlsplit(text, "file URL")
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"file URL host must be empty or localhost (write file:///abs/dir): {_quote_spec(text)}"
        )
    path = urllib.parse.unquote(parts.path)
    if not path.startswith("/"):
        raise ConfigError(f"file URL must hold an absolute path: {_quote_spec(text)}")
    params = _query(parts, FILE_URL_PARAMS, "file")
    directory: dict[str, Any] = {"path": os.path.normpath(path)}
    if "create" in params:
        directory["create"] = _bool(params["create"], "file URL parameter create")
    for name in ("keep_versions", "keep_days", "layout"):
        if name in params:
            directory[name] = params[name]  # checked by _normalize_directory
    return {"directory": directory}


def _parse_s3_url(text: str) -> dict[str, Any]:
    if "@" in text.split("?", 1)[0]:
        # Never echo it: what precedes the "@" looks like credentials.
        raise ConfigError(
            "s3 URL must not hold credentials; boto3 reads them from its default "
            "chain (environment, ~/.aws, instance role)"
        )
    parts = _urlsplit(text, "s3 URL")
    if "@" in parts.netloc:
        # Never echo the netloc: it holds what looks like credentials.
        raise ConfigError(
            "s3 URL must not hold credentials; boto3 reads them from its default "
            "chain (environment, ~/.aws, instance role)"
        )
    bucket = parts.netloc
    if not bucket:
        raise ConfigError(f"s3 URL needs a bucket: s3://CHUNK_BUCKET?...: {_quote_spec(text)}")
    if parts.path not in ("", "/"):
        raise ConfigError(
            "s3 URL path must be empty; give key prefixes with chunk_prefix= and "
            f"manifest_prefix=: {_quote_spec(text)}"
        )
    params = _query(parts, S3_URL_PARAMS, "s3")
    s3: dict[str, Any] = {"chunk_bucket": bucket}
    for name in ("manifest_bucket", "endpoint", "region"):
        if name in params:
            if not params[name]:
                raise ConfigError(f"s3 URL parameter {name} is empty")
            s3[name] = params[name]
    for name in ("chunk_prefix", "manifest_prefix"):
        if name in params:
            s3[name] = params[name]
    if "addressing" in params:
        addressing = params["addressing"].lower()
        if addressing not in ADDRESSING_ALIASES:
            raise ConfigError(
                f"s3 URL parameter addressing must be path, domain or auto, not "
                f"{_quote_spec(params['addressing'])}"
            )
        s3["addressing"] = ADDRESSING_ALIASES[addressing]
    if "create_buckets_on_demand" in params:
        s3["create_buckets_on_demand"] = _bool(
            params["create_buckets_on_demand"], "s3 URL parameter create_buckets_on_demand"
        )
    if "layout" in params:
        s3["layout"] = params["layout"]  # checked by _normalize_s3
    return {"s3": s3}


# -- targets -----------------------------------------------------------------


def store_target(config: Mapping[str, Any]) -> dict[str, Any]:
    """The normalized store target of a parsed configuration:
    ``{"kind": "directory", "path", "create", "keep_versions", "keep_days", "layout"}`` or ``{"kind": "s3", "chunk_bucket",
    "manifest_bucket", "chunk_prefix", "manifest_prefix", "endpoint", "region",
    "addressing", "create_buckets_on_demand", "layout"}``."""
    targets = config.get("replication_targets")
    if targets is None:
        raise ConfigError("configuration has no replication_targets (no store to open)")
    if not isinstance(targets, list):
        raise ConfigError("replication_targets must be a list")
    for index, target in enumerate(targets):
        if not isinstance(target, Mapping) or len(target) != 1:
            raise ConfigError(
                f"replication_targets[{index}] must be an object with one key "
                f"({', '.join(STORE_TARGET_KINDS + CACHE_TARGET_KINDS)})"
            )
        ((kind, body),) = target.items()
        if kind == "s3":
            return _normalize_s3(body, f"replication_targets[{index}].s3")
        if kind == "directory":
            return _normalize_directory(body, f"replication_targets[{index}].directory")
        if kind not in CACHE_TARGET_KINDS:
            raise ConfigError(f"replication_targets[{index}]: unknown target kind {kind!r}")
    raise ConfigError(
        "replication_targets has no s3 or directory entry "
        "(local and read_only entries are chunk caches, not stores)"
    )


def _string(body: Mapping[str, Any], name: str, where: str, *, required: bool) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise ConfigError(f"{where}.{name} is required")
        return None
    if not isinstance(value, str) or (not value and name not in ("chunk_prefix", "manifest_prefix")):
        raise ConfigError(f"{where}.{name} must be a non-empty string")
    return value


def _normalize_directory(body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ConfigError(f"{where} must be an object like {{\"path\": \"/dir\"}}")
    path = _string(body, "path", where, required=True)
    assert path is not None
    if not os.path.isabs(path) or "\0" in path:
        raise ConfigError(f"{where}.path must be an absolute path, not {_quote_spec(path)}")
    create = _bool(body.get("create", True), f"{where}.create")
    keep_versions, keep_days = _retention(body, where)
    return {"kind": "directory", "path": os.path.normpath(path), "create": create,
            "keep_versions": keep_versions, "keep_days": keep_days, "layout": _layout(body, where)}


def _layout(body: Mapping[str, Any], where: str) -> str:
    """The target's `layout`: chunks (the default) or packed."""
    value = body.get("layout", LAYOUT_CHUNKS)
    if value not in LAYOUTS:
        raise ConfigError(f"{where}.layout must be {' or '.join(LAYOUTS)}, not {_quote_spec(str(value))}")
    return value


def _retention(body: Mapping[str, Any], where: str) -> tuple[int, float]:
    """(keep_versions, keep_days) of a directory target: numbers >= 0, given
    as numbers (JSON) or text (URL)."""
    out: list[Any] = []
    for name, convert, default in (("keep_versions", int, DEFAULT_KEEP_VERSIONS),
                                   ("keep_days", float, DEFAULT_KEEP_DAYS)):
        value = body.get(name, default)
        bad = ConfigError(f"{where}.{name} must be a number >= 0, not {_quote_spec(str(value))}")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad
        try:
            number = convert(value)
        except (ValueError, OverflowError):
            raise bad from None
        if isinstance(value, float) and number != value:  # keep_versions 2.5
            raise bad
        if not 0 <= number < float("inf"):  # also refuses NaN
            raise bad
        out.append(number)
    return out[0], out[1]


def _check_bucket_name(name: str, what: str) -> None:
    if "/" in name or any(c.isspace() for c in name):
        raise ConfigError(f"{what} {_quote_spec(name)} is not a bucket name")


def _check_prefix(prefix: str, what: str) -> None:
    if prefix.startswith("/") or "\0" in prefix:
        raise ConfigError(f"{what} must not start with '/' or hold NUL: {_quote_spec(prefix)}")


def _check_endpoint(endpoint: str, what: str) -> None:
    if "@" in endpoint:
        raise ConfigError(f"{what} must not hold credentials (boto3's default chain supplies them)")
    parts = _urlsplit(endpoint, what)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} must be an http:// or https:// URL, not {_quote_spec(endpoint)}")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"{what} has an invalid port: {_quote_spec(endpoint)}") from None


def _normalize_s3(body: Any, where: str) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise ConfigError(f"{where} must be an object")
    chunk_bucket = _string(body, "chunk_bucket", where, required=True)
    manifest_bucket = _string(body, "manifest_bucket", where, required=False)
    assert chunk_bucket is not None
    if manifest_bucket is None:
        manifest_bucket = chunk_bucket
        default_chunk, default_manifest = SINGLE_BUCKET_CHUNK_PREFIX, SINGLE_BUCKET_MANIFEST_PREFIX
    else:
        default_chunk = default_manifest = ""
    chunk_prefix = _string(body, "chunk_prefix", where, required=False)
    manifest_prefix = _string(body, "manifest_prefix", where, required=False)
    chunk_prefix = default_chunk if chunk_prefix is None else chunk_prefix
    manifest_prefix = default_manifest if manifest_prefix is None else manifest_prefix
    _check_bucket_name(chunk_bucket, f"{where}.chunk_bucket")
    _check_bucket_name(manifest_bucket, f"{where}.manifest_bucket")
    _check_prefix(chunk_prefix, f"{where}.chunk_prefix")
    _check_prefix(manifest_prefix, f"{where}.manifest_prefix")
    if chunk_bucket == manifest_bucket and chunk_prefix == manifest_prefix and chunk_prefix:
        raise ConfigError(f"{where}: chunks and manifests must not share the key prefix {chunk_prefix!r}")
    endpoint = _string(body, "endpoint", where, required=False)
    if endpoint is not None:
        _check_endpoint(endpoint, f"{where}.endpoint")
    region = _string(body, "region", where, required=False)
    if "addressing" in body:  # this project's spelling (from URLs)
        addressing = ADDRESSING_ALIASES.get(str(body["addressing"]).lower())
        if addressing is None:
            raise ConfigError(f"{where}.addressing must be path, domain or auto")
    elif body.get("domain_addressing") is None:
        addressing = "auto"
    else:
        domain = _bool(body["domain_addressing"], f"{where}.domain_addressing")
        addressing = "virtual" if domain else "path"
    create = _bool(body.get("create_buckets_on_demand", False), f"{where}.create_buckets_on_demand")
    return {
        "kind": "s3",
        "chunk_bucket": chunk_bucket,
        "manifest_bucket": manifest_bucket,
        "chunk_prefix": chunk_prefix,
        "manifest_prefix": manifest_prefix,
        "endpoint": endpoint,
        "region": region,
        "addressing": addressing,
        "create_buckets_on_demand": create,
        "layout": _layout(body, where),
    }


def target_url(target: Mapping[str, Any]) -> str:
    """Canonical URL of a normalized target (`open_store` reopens it)."""
    if target["kind"] == "directory":
        url = "file://" + urllib.parse.quote(target["path"])
        options = [] if target.get("create", True) else ["create=false"]
        if target.get("keep_versions", DEFAULT_KEEP_VERSIONS) != DEFAULT_KEEP_VERSIONS:
            options.append("keep_versions=%d" % target["keep_versions"])
        if target.get("keep_days", DEFAULT_KEEP_DAYS) != DEFAULT_KEEP_DAYS:
            options.append("keep_days=%r" % target["keep_days"])
        if target.get("layout", LAYOUT_CHUNKS) != LAYOUT_CHUNKS:
            options.append("layout=" + target["layout"])
        return url + ("?" + "&".join(options) if options else "")
    params = [("manifest_bucket", target["manifest_bucket"])]
    for name in ("chunk_prefix", "manifest_prefix"):
        if target[name]:
            params.append((name, target[name]))
    for name in ("endpoint", "region"):
        if target.get(name):
            params.append((name, target[name]))
    if target["addressing"] != "auto":
        params.append(("addressing", "domain" if target["addressing"] == "virtual" else "path"))
    if target["create_buckets_on_demand"]:
        params.append(("create_buckets_on_demand", "true"))
    if target.get("layout", LAYOUT_CHUNKS) != LAYOUT_CHUNKS:
        params.append(("layout", target["layout"]))
    query = "&".join(f"{name}={urllib.parse.quote(value, safe=':/')}" for name, value in params)
    return f"s3://{target['chunk_bucket']}?{query}"


# -- opening -----------------------------------------------------------------


def open_store(spec: str | os.PathLike[str] | Mapping[str, Any] | None = None, **s3_options: Any) -> Store:
    """Open the store named by `spec` (see the module docstring).

    `s3_options` are passed to `s3.make_client` (e.g. `max_attempts=1`,
    `connect_timeout=...`) and ignored for directory stores.
    """
    target = store_target(parse_config(spec))
    url = target_url(target)
    if target["kind"] == "directory":
        root = target["path"]
        store = Store(
            chunks=LocalBackend(os.path.join(root, CHUNKS_SUBDIR), create=target["create"]),
            manifests=LocalBackend(
                os.path.join(root, MANIFESTS_SUBDIR),
                create=target["create"],
                keep_versions=target["keep_versions"],
                keep_seconds=target["keep_days"] * SECONDS_PER_DAY,
            ),
            url=url,
            layout=target["layout"],
        )
    else:
        from verneuil_fuse.store import s3  # boto3 is imported only when an S3 store is opened

        client = s3.make_client(
            endpoint=target["endpoint"],
            region=target["region"],
            addressing=target["addressing"],
            **s3_options,
        )
        one_bucket = target["chunk_bucket"] == target["manifest_bucket"]
        common = {"create_bucket_on_demand": target["create_buckets_on_demand"], "endpoint": target["endpoint"]}
        store = Store(
            # In a single bucket, chunks share the manifests' versioning.
            chunks=s3.S3Backend(
                client, target["chunk_bucket"], target["chunk_prefix"], versioned=one_bucket, **common
            ),
            manifests=s3.S3Backend(
                client, target["manifest_bucket"], target["manifest_prefix"], versioned=True, **common
            ),
            url=url,
            layout=target["layout"],
        )
    logger.debug("opened store %s", store.describe())
    return store
