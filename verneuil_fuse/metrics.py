"""The stats of a mount or a copier as Prometheus metrics, and the HTTP
endpoint that serves them.

Both programs keep their numbers as a JSON-shaped dict (the mount's
``/.verneuil/stats``, the copier's `CopierStats` and the spool's lag). A
table of `Series` (`MOUNT_SERIES`, `COPIER_SERIES`) says what each number
at a dotted stats path becomes, after Prometheus' naming rules: base units
in names (``_seconds``, ``_bytes``), ``_total`` on counters and nowhere
else, ``_timestamp_seconds`` for times (seconds since the epoch), and
settings as labels of one ``_info`` series (value 1) rather than as numbers.
A number the table lists as `LEFT_OUT` (an inode, a count of this version
alone when the running total is exported) is not a series; every number in
the stats is in the table one way or the other (the tests check it).

Labels: a section keyed by data rather than by field name (the mount's
``databases``, the copier's ``spool``) becomes one series per item, labelled
``host`` and ``path``: the writer's host name and the source database's path
there, both read from the database's manifest name (`database_labels`), so
the copier's series and the mount's series of one database join on
``(host, path)``.

Rendering is the text exposition format 0.0.4, written here rather than by
``prometheus_client``, which prints every value as a float (``256.0``, and
``1.795823192772518e+18`` for a time in nanoseconds): integers are printed
exactly, floats in Python's shortest round-trip form. `MetricsServer`
serves a render function at ``http://ADDRESS:PORT/metrics`` from a thread
of its own; each scrape calls it, so an idle endpoint costs nothing.
"""
from __future__ import annotations

import http.server
import logging
import math
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from verneuil_fuse.format import parse_manifest_name
from verneuil_fuse.format.names import MANGLE_KEEP

log = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE", "COPIER_SERIES", "COUNTER", "DEFAULT_ADDRESS", "Family", "GAUGE", "HISTOGRAM",
           "Histogram", "LEFT_OUT", "MOUNT_SERIES", "MetricsServer", "Series", "TIMESTAMP", "database_labels",
           "families", "histogram_family", "info_family", "numeric_leaves", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Loopback unless told otherwise: the series name the databases of the host.
DEFAULT_ADDRESS = "127.0.0.1"

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
TIMESTAMP = "timestamp"  # a gauge in seconds since the epoch; 0 or None = never, left out
LEFT_OUT = "left out"


@dataclass(frozen=True)
class Series:
    """What the number at stats path `path` becomes: the series `name` of
    `kind`, its value times `scale` (nanoseconds to seconds)."""
    path: str
    name: str
    kind: str
    help: str
    scale: float = 1.0


def _s(path: str, name: str, kind: str, help: str, scale: float = 1.0) -> Series:
    return Series(path, name, kind, help, scale)


def _counters(section: str, prefix: str, helps: dict[str, str]) -> list[Series]:
    """Counters whose metric name is `prefix` + the stats key + ``_total``."""
    return [_s("%s.%s" % (section, n), "%s%s_total" % (prefix, n), COUNTER, h) for n, h in helps.items()]


# The mount (`Catalog.stats`); a database's series are labelled host, path.
MOUNT_SERIES: tuple[Series, ...] = tuple(
    _counters("fetch", "verneuil_fetch_", {
        "requests": "chunks asked for by reads", "mem_hits": "chunks found in the memory cache",
        "disk_hits": "chunks found in the disk cache",
        "disk_hits_inline": "disk cache hits read in trio's thread (in the page cache)",
        "joins": "chunk requests that joined a fetch under way",
        "store_fetches": "chunk fetches from the store (retries not counted)",
        "gets": "chunk GETs sent to the store, retries included", "get_bytes": "bytes of the chunk GETs' answers",
        "get_errors": "chunk GETs that failed", "retries": "chunk GETs retried",
        "corrupt": "chunks from the store that failed their fingerprint",
        "failed": "chunks given up on (the read failed with EREMOTEIO)",
        "prefetch_requested": "chunks prefetch asked for", "prefetch_started": "prefetches started",
        "prefetch_skipped": "prefetches not needed (cached or under way)",
        "prefetch_dropped": "prefetches dropped past the bound on prefetch flights",
        "prefetch_fetched": "chunks prefetched from the store",
        "prefetch_hits": "reads served by a prefetched chunk", "manifest_gets": "manifest GETs",
        "lists": "listings of the store", "too_large": "store objects refused for their size",
        "failed_fast": "reads failed at once after a recent give-up on the same chunk",
        "prefetch_throttled": "prefetch hints dropped while the store throttles",
        "spans": "read requests answered with a view of the buffer one range GET was decoded into"})
    + [
        _s("fetch.prefetch_waste", "verneuil_fetch_prefetch_unread_chunks", GAUGE,
           "chunks prefetched and not read yet"),
        _s("fetch.inflight", "verneuil_fetch_inflight", GAUGE, "chunk fetches under way"),
        _s("fetch.mem_cache_bytes", "verneuil_fetch_mem_cache_bytes", GAUGE, "bytes in the memory chunk cache"),
        _s("fetch.store.reachable", "verneuil_fetch_store_reachable", GAUGE,
           "1 while the store answers, 0 once a chunk was given up on for want of an answer"),
        _s("fetch.store.unreachable_since", "verneuil_fetch_store_unreachable_since_timestamp_seconds", TIMESTAMP,
           "when the store stopped answering (only while it does not)"),
        _s("fetch.store.deadline", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("fetch.store.max_db_size", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("fetch.engine_path", "verneuil_fetch_engine_path", GAUGE,
           "1 while chunk GETs go through the chunk engine in C"),
        _s("fetch.throttle.limit", "verneuil_fetch_throttle_limit", GAUGE,
           "chunk GETs allowed in flight now (the adaptive limit)"),
        _s("fetch.throttle.ceiling", "", LEFT_OUT, "a setting (concurrency): verneuil_mount_settings_info"),
        _s("fetch.throttle.throttled", "verneuil_fetch_throttled", GAUGE,
           "1 while the store throttles (prefetch paused)"),
        _s("fetch.throttle.gets_per_s", "verneuil_fetch_gets_per_second", GAUGE,
           "chunk GET answers per second over the last seconds"),
        _s("fetch.throttle.throttles", "verneuil_fetch_throttled_answers_total", COUNTER,
           "answers that said the store throttles (503, 429) and timeouts"),
        _s("fetch.throttle.decreases", "verneuil_fetch_throttle_decreases_total", COUNTER,
           "times the adaptive limit was halved"),
        _s("fetch.store.credentials.ok", "verneuil_fetch_store_credentials_ok", GAUGE,
           "1 while usable credentials are at hand"),
        _s("fetch.store.credentials.expires_in", "verneuil_fetch_store_credentials_expiry_seconds", GAUGE,
           "seconds until the credentials expire"),
        _s("fetch.store.credentials.refreshing", "verneuil_fetch_store_credentials_refreshing", GAUGE,
           "1 while a refresh of the credentials runs"),
        _s("fetch.store.credentials.refreshes", "verneuil_fetch_store_credentials_refreshes_total", COUNTER,
           "credential refreshes"),
        _s("fetch.store.credentials.failures", "verneuil_fetch_store_credentials_failures_total", COUNTER,
           "credential refreshes that failed"),
        _s("fetch.disk_cache.bytes", "verneuil_fetch_disk_cache_bytes", GAUGE, "bytes in the disk cache"),
        _s("fetch.disk_cache.limit", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("fetch.disk_cache.capacity", "verneuil_fetch_disk_cache_capacity_bytes", GAUGE,
           "bytes the disk cache may hold: cache_size, or less when its disk is smaller"),
        _s("fetch.disk_cache.chunks", "verneuil_fetch_disk_cache_chunks", GAUGE, "chunks in the disk cache"),
        _s("fetch.disk_cache.segments", "verneuil_fetch_disk_cache_segments", GAUGE, "segment files of the disk cache"),
        _s("fetch.disk_cache.writes_paused", "verneuil_fetch_disk_cache_writes_paused", GAUGE,
           "1 while writes to the disk cache are paused (its file system refused one)"),
    ]
    + _counters("fetch.disk_cache", "verneuil_fetch_disk_cache_", {
        "hits": "disk cache lookups that found the chunk", "misses": "disk cache lookups that did not",
        "corrupt": "disk cache entries that failed their fingerprint (dropped)", "puts": "chunks written",
        "evicted_segments": "segment files evicted to keep the bound", "rescans": "rescans of the directory",
        "write_pauses": "pauses of writes after a write the file system refused",
        "puts_skipped": "chunks not written (writes paused, or already cached)",
        "unused_slots": "places reserved for fetches that failed (holes)"})
    + _counters("refresh", "verneuil_refresh_", {
        "polls": "listings of the store", "errors": "polls or manifest reads that failed",
        "versions_seen": "database versions installed"})
    + [
        _s("refresh.interval", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("refresh.bad_manifests", "verneuil_refresh_bad_manifests", GAUGE,
           "manifests that do not decode, left out of the tree until they change"),
        _s("refresh.last_poll", "verneuil_refresh_last_poll_timestamp_seconds", TIMESTAMP, "the last listing of the store"),
        _s("catalog.databases", "verneuil_catalog_databases", GAUGE, "databases in the tree"),
        _s("catalog.read", "verneuil_catalog_databases_read", GAUGE, "databases whose manifest was read"),
        _s("catalog.decoded", "verneuil_catalog_manifests_decoded", GAUGE, "manifests decoded in memory"),
        _s("catalog.decoded_limit", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
    ]
    + _counters("catalog", "verneuil_catalog_", {
        "loads": "manifests read at a lookup", "unparks": "parked manifests decoded again",
        "parks": "decoded manifests parked past the bound", "stale": "parked versions gone from the store",
        "direct_lookups": "names looked up in the store before a poll listed them",
        "direct_found": "of which found",
        "cache_dropped": "manifest cache entries that did not decode, dropped and read from the store"})
    + _counters("catalog.manifest_cache", "verneuil_catalog_manifest_cache_", {
        "hits": "manifests read from the manifest cache on disk", "misses": "manifests it did not hold",
        "errors": "manifest cache operations that failed",
        "skipped": "manifests not kept: their disk had no room left past its reserve"})
    + [
        _s("databases.len", "verneuil_database_size_bytes", GAUGE, "size of the version served"),
        _s("databases.chunks", "verneuil_database_chunks", GAUGE, "chunks of the version served"),
        _s("databases.inode", "", LEFT_OUT, "an identifier"),
        _s("databases.mtime_ns", "verneuil_database_mtime_timestamp_seconds", TIMESTAMP,
           "the source's time in the version served (its manifest's ctime)", 1e-9),
        _s("databases.opens", "verneuil_database_open_handles", GAUGE, "handles open on the version served"),
        _s("databases.reads", "", LEFT_OUT, "this version's: databases.since_mount.reads is the series"),
        _s("databases.read_bytes", "", LEFT_OUT, "this version's: databases.since_mount.read_bytes is the series"),
        _s("databases.preloaded", "", LEFT_OUT, "this version's: databases.since_mount.preloaded is the series"),
        _s("databases.since_mount.opens", "verneuil_database_opens_total", COUNTER,
           "opens of the database, every version, since the mount started"),
        _s("databases.since_mount.reads", "verneuil_database_reads_total", COUNTER,
           "reads of the database, every version, since the mount started"),
        _s("databases.since_mount.read_bytes", "verneuil_database_read_bytes_total", COUNTER,
           "bytes read from the database, every version, since the mount started"),
        _s("databases.since_mount.preloaded", "verneuil_database_preloaded_bytes_total", COUNTER,
           "bytes stored in the page cache at the first open of each version"),
        _s("databases.btree_pages_known", "verneuil_database_btree_pages_known", GAUGE,
           "interior b-tree pages known for prefetch"),
        _s("databases.old_versions_open", "verneuil_database_old_versions_open", GAUGE,
           "older versions still held by a handle or the kernel"),
        _s("databases.hydration.chunks", "verneuil_database_hydration_chunks", GAUGE,
           "chunks the current hydration pass fetches"),
        _s("databases.hydration.fetched", "verneuil_database_hydration_fetched_chunks", GAUGE,
           "chunks the current hydration pass fetched"),
        _s("databases.hydration.failed", "verneuil_database_hydration_failed_chunks", GAUGE,
           "chunks the current hydration pass could not fetch"),
        _s("databases.handles", "verneuil_database_open_handles_all_versions", GAUGE,
           "handles open on the database, whatever version each reads"),
        _s("databases.handles_behind", "verneuil_database_open_handles_behind", GAUGE,
           "handles open on an older version than the newest (they move at their next transaction)"),
        _s("databases.served", "verneuil_database_versions_served", GAUGE, "versions that open handles read"),
        _s("databases.newest_age_s", "verneuil_database_newest_age_seconds", GAUGE,
           "age of the newest version known (now minus its commit time, the manifest's ctime)"),
        _s("databases.oldest_served_age_s", "verneuil_database_oldest_served_age_seconds", GAUGE,
           "age of the oldest version an open handle reads (0: none open)"),
        _s("follow.enabled", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("follow.interval", "", LEFT_OUT, "a setting: verneuil_mount_settings_info"),
        _s("follow.watched", "verneuil_follow_watched_databases", GAUGE,
           "databases the follow loop checked in its last pass (open or opened recently)"),
        _s("follow.followers", "verneuil_follow_followers", GAUGE, "follower inodes (one per open handle, and free ones)"),
        _s("follow.lag_visible_count", "", LEFT_OUT, "the histogram verneuil_follow_lag_seconds"),
        _s("follow.lag_visible_sum_s", "", LEFT_OUT, "the histogram verneuil_follow_lag_seconds"),
        _s("follow.lag_switched_count", "", LEFT_OUT, "the histogram verneuil_follow_lag_seconds"),
        _s("follow.lag_switched_sum_s", "", LEFT_OUT, "the histogram verneuil_follow_lag_seconds"),
        _s("mount.pid", "", LEFT_OUT, "an identifier: verneuil_mount_info"),
        _s("mount.started", "verneuil_mount_start_timestamp_seconds", TIMESTAMP, "when the mount process started"),
        _s("mount.ready", "verneuil_mount_ready", GAUGE, "1 once the mount is up and tuned"),
    ]
    + _counters("follow", "verneuil_follow_", {
        "passes": "passes of the follow loop", "checks": "conditional manifest reads of databases in use",
        "not_modified": "of which unchanged (304, or the same file)", "bodies": "of which changed (a manifest read)",
        "new_versions": "new versions the follow loop found", "errors": "checks that failed",
        "created": "follower inodes made", "estale": "opens of a taken follower answered ESTALE (the kernel looks again)",
        "switches": "open handles moved to a newer version", "transaction_starts": "SQLite transaction starts seen",
        "generations": "page cache drops of followers behind"})
    + _counters("mount", "verneuil_mount_", {
        "read_errors": "reads answered with an error (EREMOTEIO or EIO)",
        "handler_errors": "FUSE requests that failed unexpectedly (EIO; a traceback in the log)"})
)

# The copier (`CopierStats`) and its spool (`spool_status` without a store);
# a database's series are labelled host, path.
COPIER_SERIES: tuple[Series, ...] = tuple(
    _counters("copier", "verneuil_copier_", {
        "passes": "passes over the spool", "chunks_uploaded": "chunks uploaded",
        "chunks_skipped": "chunks not sent again (uploaded recently)", "manifests_uploaded": "manifests uploaded",
        "manifests_skipped": "staged manifests the store already held",
        "dead_letters": "spool entries moved to dead-letter/", "touches": "live chunks touched",
        "touch_missing": "live chunks the store no longer had when touched",
        "errors": "passes or uploads that failed", "requests": "store requests",
        "packs_uploaded": "packs uploaded (packed layout; chunks_uploaded counts their chunks)",
        "chunks_repacked": "chunks packed again by compaction (packed layout)",
        "packs_deleted": "packs no kept version needs, deleted (packed layout)"})
    + [
        _s("copier.chunk_bytes_raw", "verneuil_copier_chunk_uncompressed_bytes_total", COUNTER,
           "bytes of the chunks uploaded, before compression"),
        _s("copier.chunk_bytes_sent", "verneuil_copier_chunk_sent_bytes_total", COUNTER,
           "bytes of the chunks uploaded, as sent (compressed)"),
        _s("copier.last_upload", "verneuil_copier_last_upload_timestamp_seconds", TIMESTAMP,
           "the copier's last manifest upload"),
        _s("copier.started", "verneuil_copier_start_timestamp_seconds", TIMESTAMP, "when the copier started"),
        _s("spool.wal", "verneuil_spool_wal", GAUGE,
           "1: the database is in WAL mode (replicated like any other)"),
        _s("spool.staged_chunks", "verneuil_spool_staged_chunks", GAUGE, "staged chunks not uploaded yet"),
        _s("spool.staged_chunk_bytes", "verneuil_spool_staged_chunk_bytes", GAUGE, "bytes of the staged chunks"),
        _s("spool.ready", "verneuil_spool_ready_snapshots", GAUGE, "snapshots ready to ship"),
        _s("spool.consuming", "verneuil_spool_consuming_snapshots", GAUGE, "snapshots being shipped"),
        _s("spool.pending_bytes", "verneuil_spool_pending_bytes", GAUGE, "chunk bytes the spool still has to ship"),
        _s("spool.manifests", "verneuil_spool_staged_manifests", GAUGE, "staged manifests"),
        _s("spool.source_changed", "verneuil_spool_source_changed", GAUGE,
           "1: the file changed since its last snapshot (writes the VFS could not snapshot)"),
        _s("spool.lag", "verneuil_spool_lag_seconds", GAUGE,
           "age of the oldest snapshot not shipped yet (0: nothing pending)"),
        _s("spool.snapshotted", "verneuil_spool_snapshotted", GAUGE,
           "1 once the spool holds a snapshot of the database (0: never snapshotted, nothing of it shipped)"),
        _s("spool.in_sync", "", LEFT_OUT, "known only against the store, which the exporter does not ask"),
        _s("spool.stopped.since", "verneuil_spool_stopped_since_timestamp_seconds", TIMESTAMP,
           "when a copier refused the database (past max_db_size): it stopped replicating"),
        _s("spool.dead_letters.entries", "verneuil_spool_dead_letters", GAUGE, "entries kept in dead-letter/"),
        _s("spool.dead_letters.bytes", "verneuil_spool_dead_letter_bytes", GAUGE, "bytes kept in dead-letter/"),
        _s("spool.dead_letters.dropped", "verneuil_spool_dead_letters_dropped_total", COUNTER,
           "dead letters dropped, oldest first, to keep dead-letter/ within its bound"),
    ]
)


@dataclass
class Family:
    """One metric family: its name, Prometheus type, help and samples
    (labels, value), or (labels, value, suffix) where a sample's name is the
    family's plus a suffix (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
    name: str
    type: str
    help: str
    samples: list[tuple] = field(default_factory=list)


class Histogram:
    """Observations counted in buckets by upper bound, for a Prometheus
    histogram (`histogram_family`); kept as counts, not samples, so its
    size does not grow with what it counts."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations at or below it) for every bound, then +Inf."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return out


def histogram_family(name: str, help: str, label: str, histograms: dict[str, Histogram]) -> Family:
    """One histogram family `name`, a series per entry of `histograms`
    labelled ``label=<its key>``: its buckets, sum and count."""
    family = Family(name, HISTOGRAM, help)
    for key, h in sorted(histograms.items()):
        for le, n in h.cumulative():
            family.samples.append(({label: key, "le": le}, n, "_bucket"))
        family.samples.append(({label: key}, h.sum, "_sum"))
        family.samples.append(({label: key}, h.count, "_count"))
    return family


def numeric_leaves(value, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], int | float]]:
    """(path, number) for every number, boolean (0/1) and list (its length)
    under `value`; strings and None are not numbers."""
    if isinstance(value, bool):
        yield path, int(value)
    elif isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, (list, tuple)):
        yield path, len(value)
    elif isinstance(value, dict):
        for key, sub in value.items():
            yield from numeric_leaves(sub, path + (str(key),))


def database_labels(key: str, fallback_path: str = "", fallback_host: str = "") -> dict[str, str]:
    """The ``host`` and ``path`` labels of the database whose manifest name
    is `key`: the writer's host name and the source path, as written; a
    mangled name's path is its kept ends around ``…<12 hex>…``. A key that
    is no manifest name gives the fallbacks."""
    parsed = parse_manifest_name(key) if key else None
    if parsed is None:
        return {"host": fallback_host, "path": fallback_path}
    if parsed.mangled:
        mark = "\u2026" + key[MANGLE_KEEP:MANGLE_KEEP + 12] + "\u2026"
        head = re.sub(r"\A[0-9a-f]{4}/", "", parsed.prefix)  # the path's hash, as in a whole name
        return {"host": parsed.hostname, "path": head + mark + parsed.suffix}
    return {"host": parsed.hostname, "path": parsed.path}


def families(stats: dict, table: Iterable[Series],
             labelled: dict[str, Callable[[str, dict], dict[str, str]]]) -> list[Family]:
    """The families of `table` that `stats` has numbers for. `labelled`
    maps a section keyed by data (``databases``) to a function of an item's
    key and dict that gives its labels."""
    by_path = {s.path: s for s in table}
    out: dict[str, Family] = {}

    def add(path: tuple[str, ...], value, labels: dict[str, str]) -> None:
        series = by_path.get(".".join(path))
        if series is None or series.kind == LEFT_OUT:
            return
        if series.kind == TIMESTAMP and not value:
            return  # never happened: no series rather than 1970
        family = out.get(series.name)
        if family is None:
            kind = COUNTER if series.kind == COUNTER else GAUGE
            family = out[series.name] = Family(series.name, kind, series.help)
        family.samples.append((labels, value * series.scale if series.scale != 1.0 else value))

    for top, value in stats.items():
        label_of = labelled.get(top)
        if label_of is not None and isinstance(value, dict):
            for item, fields in value.items():
                labels = label_of(item, fields)
                for path, number in numeric_leaves(fields, (top,)):
                    add(path, number, labels)
        else:
            for path, number in numeric_leaves(value, (top,)):
                add(path, number, {})
    return list(out.values())


def info_family(name: str, help: str, labels: dict) -> Family:
    """``NAME{labels} 1``: what a process is, or its settings (numbers as
    labels, printed as `render` prints values)."""
    return Family(name, GAUGE, help, [({k: v if isinstance(v, str) else _value(v) for k, v in labels.items()
                                        if v is not None}, 1)])


def _value(v) -> str:
    """A sample value as the text format wants it, integers exactly."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return "%d" % v
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2 ** 53:
        return "%d" % v
    return repr(v)


def _escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{%s}" % ",".join('%s="%s"' % (k, _escape(str(v), True)) for k, v in sorted(labels.items()))


def render(metric_families: Iterable[Family]) -> bytes:
    """The text exposition (version 0.0.4) of `metric_families`."""
    lines = []
    for f in metric_families:
        lines.append("# HELP %s %s" % (f.name, _escape(f.help, False)))
        lines.append("# TYPE %s %s" % (f.name, f.type))
        for labels, value, *suffix in f.samples:
            lines.append("%s%s%s %s" % (f.name, suffix[0] if suffix else "", _labels(labels), _value(value)))
    return ("\n".join(lines) + "\n").encode("utf-8", "replace") if lines else b""


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "_Server"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._reply(404, b"not found: the metrics are at /metrics\n", "text/plain; charset=utf-8")
            return
        try:
            body = self.server.render()
        except Exception as e:  # noqa: BLE001 - one failed scrape, not a dead endpoint
            log.warning("metrics: a scrape failed: %s", e)
            self._reply(503, ("cannot render the metrics now: %s\n" % e).encode(), "text/plain; charset=utf-8")
            return
        self._reply(200, body, CONTENT_TYPE)

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
        log.debug("metrics: %s " + format, self.address_string(), *args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    render: Callable[[], bytes]


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``http://ADDRESS:PORT/metrics``: `render()` at each scrape, on a
    thread of its own (port 0: a free one, in `.port` and `.url`). Binding
    errors (a port in use) raise OSError at once."""

    def __init__(self, render: Callable[[], bytes], port: int, address: str = DEFAULT_ADDRESS):
        self._server = (_Server6 if ":" in address else _Server)((address, port), _Handler)
        self._server.render = render
        self.port = self._server.server_address[1]
        host = "[%s]" % address if ":" in address else address
        self.url = "http://%s:%d/metrics" % (host, self.port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
