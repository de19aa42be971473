"""The catalog's numbers: ``/.verneuil/stats`` (JSON: the fetcher's, the
polls', the catalog's, per database the versions decoded, open or under
hydration) and ``/.verneuil/metrics`` (the same in Prometheus' text
format, `verneuil_fuse.metrics`).

Tested by tests/test_metrics.py and tests/test_mount_prometheus.py.
"""
from __future__ import annotations

import json
import os

from verneuil_fuse import __version__, metrics
from verneuil_fuse.reader.replica import Replica
from verneuil_fuse.reader.tree import DbEntry, Parked


class CatalogStats:
    """The stats and metrics of `catalog.Catalog` (see the module's docstring)."""

    def known_bytes(self) -> int:
        """The sizes of the databases whose manifest was read."""
        return sum(e.current.size for e in self.entries.values() if e.current is not None)

    def stats(self) -> dict:
        """The numbers of /.verneuil/stats. Per database, only the decoded
        versions (at most ``decoded_limit``, and the open ones) and those
        under hydration: a mount of 100,000 databases renders its stats in
        milliseconds, not seconds."""
        old_open: dict[str, int] = {}
        held: dict[str, list[int]] = {}  # reads, read bytes, preloaded bytes of the versions held
        for node in self.inodes.values():
            if isinstance(node, (Replica, Parked)):
                counts = held.setdefault(node.key, [0, 0, 0])
                counts[0] += node.reads
                counts[1] += node.read_bytes
                counts[2] += node.preloaded
                if not self._is_current(node):
                    old_open[node.key] = old_open.get(node.key, 0) + 1
        served: dict[str, list[Replica]] = {}
        for replica in self._decoded.values():
            if replica.opens > 0:
                served.setdefault(replica.key, []).append(replica)
        dbs = {}
        for entry in self.entries.values():
            h = self._hydrations.get(entry.key)
            if isinstance(entry.current, Replica):
                d = entry.current.describe()
            elif h is not None or entry.key in served:  # hydrated, queued for it, parked since, or open
                d = {"path": os.path.join(entry.parent.path, entry.name), "key": entry.key}
            else:  # known by name, or parked: counted in "catalog" only
                continue
            d["old_versions_open"] = old_open.get(entry.key, 0)
            totals = [a + b for a, b in zip(held.get(entry.key, (0, 0, 0)), self._retired.get(entry.key, (0, 0, 0)))]
            d["since_mount"] = {"opens": self._opens_total.get(entry.key, 0), "reads": totals[0],
                                "read_bytes": totals[1], "preloaded": totals[2]}
            d.update(self._versions_served(entry, served.get(entry.key, [])))
            if h is not None:
                d["hydration"] = h.describe()
            dbs[d["path"]] = d
        read = sum(1 for e in self.entries.values() if e.current is not None)
        catalog = {"databases": len(self.entries), "read": read, "decoded": len(self._decoded),
                   "decoded_limit": self.decoded_limit, **self.counts}
        if self.manifest_cache is not None:
            catalog["manifest_cache"] = self.manifest_cache.stats()
        out = {
            "fetch": self.fetcher.snapshot(),
            "refresh": {
                "interval": self.refresh_interval,
                "polls": self.polls,
                "errors": self.poll_errors,
                "bad_manifests": sorted(self._bad),
                "last_poll": self.last_poll,
                "versions_seen": self.versions_seen,
            },
            "catalog": catalog,
            "databases": dict(sorted(dbs.items())),
        }
        if self.extra_stats is not None:
            out.update(self.extra_stats())
        return out

    def _versions_served(self, entry: DbEntry, open_versions: list[Replica]) -> dict:
        """What a database's open handles read against its newest version:
        the versions served (how many handles each, and the age of each:
        now minus its commit time, the manifest's ctime), the newest's age."""
        now = self.clock()
        current = entry.current

        def age(mtime_ns: int) -> float:
            return round(max(0.0, now - mtime_ns / 1e9), 3)

        rows = [{"version": r.version, "handles": r.opens, "age_s": age(r.mtime_ns)}
                for r in sorted(open_versions, key=lambda r: r.mtime_ns)]
        behind = sum(r.opens for r in open_versions if r is not current)
        return {"newest_age_s": age(current.mtime_ns) if current is not None else 0.0,
                "handles": sum(r.opens for r in open_versions), "handles_behind": behind,
                "served": rows, "oldest_served_age_s": rows[0]["age_s"] if rows else 0.0}

    def render_stats(self) -> bytes:
        return (json.dumps(self.stats(), indent=1, sort_keys=True) + "\n").encode()

    def render_metrics(self) -> bytes:
        """`stats` in Prometheus' text format (`metrics.MOUNT_SERIES`), the
        databases labelled by host and source path; ``verneuil_mount_info``
        names the mount, ``verneuil_mount_settings_info`` holds its settings."""
        stats = self.stats()
        mount = stats.get("mount", {})
        info = {"version": __version__, "source": mount.get("source"), "mountpoint": mount.get("mountpoint"),
                "pid": mount.get("pid"), "cache_dir": mount.get("cache_dir")}
        store = stats["fetch"]["store"]
        follow = stats.get("follow", {})
        settings = {"refresh_interval_seconds": self.refresh_interval, "deadline_seconds": store["deadline"],
                    "max_db_size_bytes": store["max_db_size"], "decoded_limit": self.decoded_limit,
                    "disk_cache_limit_bytes": stats["fetch"].get("disk_cache", {}).get("limit", 0),
                    "follow": follow.get("enabled"), "follow_interval_seconds": follow.get("interval")}
        labels = {"databases": lambda path, d: metrics.database_labels(d.get("key", ""), path)}
        lag = metrics.histogram_family(
            "verneuil_follow_lag_seconds", "commit (the manifest's ctime) to a version visible to new opens "
            "(event=visible) or read by an open handle that moved to it (event=switched)", "event", self.lag)
        return metrics.render([metrics.info_family("verneuil_mount_info", "what this mount is", info),
                               metrics.info_family("verneuil_mount_settings_info", "the mount's settings", settings)]
                              + metrics.families(stats, metrics.MOUNT_SERIES, labels) + [lag])
