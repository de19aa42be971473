"""A copier's metrics over HTTP, for Prometheus (``verneuilctl copier
--metrics-port``).

At each scrape: the copier's counters (`CopierStats`, as
``verneuil_copier_*``) and, per database of the spool, what `spool_status`
reports without asking the store (``verneuil_spool_*``: pending bytes, the
age of the oldest snapshot not yet shipped as ``lag_seconds``, whether it
is in WAL mode),
labelled ``host`` and ``path`` as the mount labels the same database
(`metrics.database_labels` of its staged manifest's name);
``verneuil_copier_info`` names the copier and
``verneuil_copier_settings_info`` holds its settings. The spool is read at
each scrape, never in between, so an idle exporter costs nothing.
"""
from __future__ import annotations

import logging
import os
import time

from verneuil_fuse import __version__, metrics
from verneuil_fuse.format import local_hostname
from verneuil_fuse.copier.copier import Copier
from verneuil_fuse.copier.spool import NotASpool
from verneuil_fuse.copier.status import spool_status

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = metrics.DEFAULT_ADDRESS


def _labels(db: dict) -> dict[str, str]:
    """A spool database's labels: from its staged manifest's name, else
    this host and its source path (a database never snapshotted)."""
    for m in db["manifests"]:
        labels = metrics.database_labels(m["name"])
        if labels["host"]:
            return labels
    return {"host": local_hostname(), "path": db["source"] or db["dbdir"]}


def copier_families(copier: Copier, started: float = 0.0) -> list[metrics.Family]:
    """The metric families of `copier` and its spool, now."""
    stats: dict = {"copier": dict(copier.stats_snapshot(), started=started)}
    try:
        spool = {db["dbdir"]: db for db in spool_status(copier.spool_dir, max_db_size=copier.max_db_size)}
    except (OSError, NotASpool) as e:
        log.warning("metrics: cannot read the spool %s: %s", copier.spool_dir, e)
        spool = {}
    stats["spool"] = spool
    info = {"version": __version__, "spool": copier.spool_dir, "store": copier.store.describe(),
            "host": local_hostname(), "pid": os.getpid()}
    settings = {"rate": copier.bucket.rate, "burst": copier.bucket.burst, "workers": copier.workers,
                "db_workers": copier.db_workers, "poll_interval_seconds": copier.poll_interval,
                "lock_timeout_seconds": copier.lock_timeout, "touch_interval_seconds": copier.touch_interval}
    return ([metrics.info_family("verneuil_copier_info", "what this copier is", info),
             metrics.info_family("verneuil_copier_settings_info", "the copier's settings", settings)]
            + metrics.families(stats, metrics.COPIER_SERIES, {"spool": lambda _name, db: _labels(db)}))


class MetricsServer(metrics.MetricsServer):
    """The copier's HTTP endpoint (``/metrics``) on its own thread."""

    def __init__(self, copier: Copier, port: int, address: str = DEFAULT_ADDRESS):
        started = time.time()
        super().__init__(lambda: metrics.render(copier_families(copier, started)), port, address)


__all__ = ["DEFAULT_ADDRESS", "MetricsServer", "copier_families"]
