"""A real Prometheus (Debian's `prometheus`) scrapes a copier and a mount of
the store it fills, both over HTTP (`--metrics-port`, `metrics_port=`):
both targets are up, and PromQL joins the copier's series of a database
with the mount's on (host, path). Every process started here is ended by
its PID; the mount is always unmounted."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from support.copier_support import CopierDaemon, Writer
from support.replicas import Mount, fuse_unavailable, stop_pid, wait_for
from verneuil_fuse.format import local_hostname

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))
if shutil.which("prometheus") is None:
    pytestmark.append(pytest.mark.skip(reason="no prometheus (Debian's package; scripts/setup.sh installs it)"))

# Seconds between scrapes: the least Prometheus takes, so the test waits
# about a second for each answer.
SCRAPE_INTERVAL = "1s"
# Seconds for Prometheus to start, scrape both targets and answer the join.
PROMETHEUS_WAIT = 60

CONFIG = """\
global:
  scrape_interval: {interval}
  scrape_timeout: {interval}
scrape_configs:
  - job_name: verneuil-copier
    static_configs: [{{targets: ["{copier}"]}}]
  - job_name: verneuil-mount
    static_configs: [{{targets: ["{mount}"]}}]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, promql: str) -> list:
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": promql}))
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            answer = json.load(r)
    except OSError:
        return []  # not listening yet
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_prometheus_scrapes_and_joins_the_copier_and_the_mount(tmp_path):
    spool, store = str(tmp_path / "spool"), "file://%s/store" % tmp_path
    source = os.path.realpath(str(tmp_path / "app.db"))
    w = Writer("py", spool, source)
    prometheus = None
    try:
        w.bump()
        with CopierDaemon(spool, store, "--metrics-port", "0") as copier:
            copier_url = re.search(r"metrics on (http://\S+/metrics)", copier.until("metrics on")).group(1)
            os.makedirs(str(tmp_path / "store" / "manifests"), exist_ok=True)
            mount = Mount.under(str(tmp_path), store, "refresh=0.5,metrics_port=0")
            with mount:
                where = mount.path(local_hostname(), source)
                wait_for(lambda: os.path.exists(where), 30, "the database on the mount")
                size = len(open(where, "rb").read())
                mount_url = mount.stats()["mount"]["metrics_url"]
                port = _free_port()
                config = tmp_path / "prometheus.yml"
                config.write_text(CONFIG.format(interval=SCRAPE_INTERVAL, copier=copier_url.split("/")[2],
                                                mount=mount_url.split("/")[2]))
                log = open(str(tmp_path / "prometheus.log"), "wb")
                prometheus = subprocess.Popen(
                    ["prometheus", "--config.file=%s" % config, "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
                     "--web.listen-address=127.0.0.1:%d" % port, "--log.level=warn"],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL)
                log.close()
                up = wait_for(lambda: len([r for r in _query(port, "up == 1")]) == 2 or None, PROMETHEUS_WAIT,
                              "both targets up in Prometheus")
                assert up
                joined = wait_for(lambda: _query(port, "verneuil_database_size_bytes * on(host, path) "
                                                       "group_left() verneuil_spool_snapshotted"),
                                  PROMETHEUS_WAIT, "the join of the mount's and the copier's series")
                (row,) = joined
                assert row["metric"]["host"] == local_hostname() and row["metric"]["path"] == source, row
                assert row["metric"]["job"] == "verneuil-mount" and float(row["value"][1]) == size
                opens = wait_for(lambda: _query(port, 'verneuil_database_opens_total{path="%s"} > 0' % source),
                                 PROMETHEUS_WAIT, "the mount's count of opens")
                assert opens and _query(port, "verneuil_spool_lag_seconds") != []
            copier.stop()
    finally:
        w.close()
        if prometheus is not None:
            stop_pid(prometheus.pid, 10)
            prometheus.wait(timeout=10)
