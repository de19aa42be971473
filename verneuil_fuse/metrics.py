"""The stats of a mount or a copier in Prometheus' text exposition format.

Both programs already keep their counters as a JSON-shaped dict (the mount's
``/.verneuil/stats``, the copier's `CopierStats` and the spool's lag).  This
module turns such a dict into metric families, so that the two views always
carry the same numbers: every number or boolean at a path ``a.b.c`` becomes
the metric ``verneuil_a_b_c`` (``verneuil_fetch_gets_total``,
``verneuil_copier_chunks_uploaded_total``); a counter (monotonic since the process started)
gets Prometheus' ``_total`` suffix, everything else is a gauge.  Which paths
are gauges is listed here (`MOUNT_GAUGES`, `COPIER_GAUGES`); numbers not
listed are counters, the common case.

Dicts keyed by data rather than by field name (the mount's ``databases``,
keyed by path) become one family per field with a label (``path="..."``).
Strings and ``None`` are not numbers and are left out, except the few that
name the process (`info` labels); a list is exposed as its length.

Rendering goes through `prometheus_client` (escaping, ``# HELP``/``# TYPE``
lines, the copier's HTTP endpoint); `render` is pure and needs no registry
of its own, since nothing here is kept between two scrapes.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                   Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["CONTENT_TYPE_LATEST", "MOUNT_GAUGES", "COPIER_GAUGES", "Histogram", "StatsCollector", "render", "families",
           "histogram_family"]

# Paths (dots between keys; a labelled dict's key left out) whose value can
# go down: sizes, states, settings, times.  Every other number is a counter.
MOUNT_GAUGES = frozenset({
    "fetch.prefetch_waste", "fetch.inflight", "fetch.mem_cache_bytes",
    "fetch.store.reachable", "fetch.store.unreachable_since", "fetch.store.deadline",
    "fetch.store.max_db_size",
    "fetch.disk_cache.bytes", "fetch.disk_cache.limit", "fetch.disk_cache.capacity",
    "fetch.disk_cache.chunks", "fetch.disk_cache.segments", "fetch.disk_cache.writes_paused",
    "refresh.interval", "refresh.bad_manifests", "refresh.last_poll",
    "mount.pid", "mount.ready",
    "databases.len", "databases.chunks", "databases.inode", "databases.mtime_ns",
    "databases.opens", "databases.preloaded", "databases.btree_pages_known",
    "databases.old_versions_open", "databases.newest_age_s", "databases.handles", "databases.handles_behind",
    "databases.served", "databases.oldest_served_age_s",
    "follow.enabled", "follow.interval", "follow.followers", "follow.watched",
    "databases.hydration.chunks", "databases.hydration.fetched", "databases.hydration.failed",
})
COPIER_GAUGES = frozenset({
    "copier.last_upload",
    "spool.wal", "spool.staged_chunks", "spool.staged_chunk_bytes", "spool.ready",
    "spool.consuming", "spool.pending_bytes", "spool.manifests", "spool.source_changed",
    "spool.lag", "spool.in_sync",
})

# What a path's key becomes in a metric name: Prometheus allows
# [a-zA-Z0-9_:], and ':' is kept for recording rules.
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


def _name(parts: Iterable[str]) -> str:
    return "_".join(_NOT_NAME.sub("_", p) for p in parts)


def _leaves(value, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], float]]:
    """(path, number) for every number, boolean and list under `value`."""
    if isinstance(value, bool):
        yield path, float(value)
    elif isinstance(value, (int, float)):
        yield path, float(value)
    elif isinstance(value, (list, tuple)):
        yield path, float(len(value))
    elif isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, path + (str(key),))


def families(prefix: str, stats: dict, gauges: frozenset[str],
             labelled: dict[str, str], info: tuple[str, dict[str, str]] | None = None) -> list[Metric]:
    """Metric families for `stats`, named ``PREFIX_<path>``.

    `labelled` maps a top-level key whose dict is keyed by data to the label
    that carries those keys (``{"databases": "path"}``).  `info`, a name and
    labels, becomes ``PREFIX_<name>_info{labels} 1``."""
    out: dict[str, Metric] = {}

    def add(path: tuple[str, ...], value: float, labels: dict[str, str]) -> None:
        dotted = ".".join(path)
        name = _name((prefix,) + path)
        family = out.get(name)
        if family is None:
            doc = "%s in the stats (%s)" % (dotted, "gauge" if dotted in gauges else "counter")
            cls = GaugeMetricFamily if dotted in gauges else CounterMetricFamily
            family = out[name] = cls(name, doc, labels=sorted(labels))
        family.add_metric([labels[k] for k in sorted(labels)], value)

    for top, value in stats.items():
        label = labelled.get(top)
        if label is not None and isinstance(value, dict):
            for item, fields in value.items():
                for path, number in _leaves(fields, ()):
                    add((top,) + path, number, {label: str(item)})
        else:
            for path, number in _leaves(value, (top,)):
                add(path, number, {})
    result: list[Metric] = []
    if info is not None:
        what, labels = info
        family = InfoMetricFamily(_name((prefix, what)), "what this process is", labels=sorted(labels))
        family.add_metric([labels[k] for k in sorted(labels)], {})
        result.append(family)
    result.extend(out.values())
    return result


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

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations at or below it) for every bound, then +Inf."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
        return out


def histogram_family(name: str, doc: str, label: str, histograms: dict[str, Histogram]) -> Metric:
    """One histogram family ``name``, a series per entry of `histograms`
    labelled ``label=<its key>``."""
    family = HistogramMetricFamily(name, doc, labels=[label])
    for value, h in sorted(histograms.items()):
        family.add_metric([value], h.cumulative(), h.sum)
    return family


class StatsCollector(Collector):
    """A `prometheus_client` collector over a function that returns the
    current metric families (called at each scrape)."""

    def __init__(self, collect_families):
        self._collect = collect_families

    def collect(self) -> Iterable[Metric]:
        return self._collect()


def render(metric_families: list[Metric]) -> bytes:
    """The text exposition of `metric_families` (version 0.0.4)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(lambda: metric_families))
    return generate_latest(registry)
