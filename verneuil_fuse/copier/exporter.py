"""A copier's metrics over HTTP, for Prometheus (``verneuilctl copier
--metrics-port``).

At each scrape: the copier's counters (`CopierStats`, as
``verneuil_copier_*``) and, per database of the spool, what `spool_status`
reports without asking the store (``verneuil_spool_*{db="..."}``: pending
bytes, the age of the oldest snapshot not yet shipped as ``lag``, whether it
is in WAL mode).
The spool is read at each scrape, never in between, so an idle exporter
costs nothing.
"""
from __future__ import annotations

import logging
import threading

from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from .. import __version__, metrics
from .copier import Copier
from .spool import NotASpool
from .status import spool_status

log = logging.getLogger(__name__)

# Loopback unless told otherwise: the figures name the databases of the host.
DEFAULT_ADDRESS = "127.0.0.1"


def copier_families(copier: Copier) -> list:
    """The metric families of `copier` and its spool, now."""
    stats: dict = {"copier": copier.stats_snapshot()}
    try:
        spool = {db["source"] or db["dbdir"]: db for db in spool_status(copier.spool_dir)}
    except (OSError, NotASpool) as e:
        log.warning("metrics: cannot read the spool %s: %s", copier.spool_dir, e)
        spool = {}
    stats["spool"] = spool
    info = {"version": __version__, "spool": copier.spool_dir, "store": copier.store.describe()}
    return metrics.families("verneuil", stats, metrics.COPIER_GAUGES, {"spool": "db"}, ("copier", info))


class MetricsServer:
    """The HTTP endpoint (``/metrics``, or any path) on its own thread."""

    def __init__(self, copier: Copier, port: int, address: str = DEFAULT_ADDRESS):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(metrics.StatsCollector(lambda: copier_families(copier)))
        self._server, self._thread = start_http_server(port, addr=address, registry=registry)
        self.port = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


__all__ = ["DEFAULT_ADDRESS", "MetricsServer", "copier_families"]
