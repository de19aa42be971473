"""Writer -> spool -> copier -> store -> restore, for real (bounded in time).

Writers: the Python reference writer always, the C VFS when built (see
copier_support.WRITER_KINDS).  Stores: a directory and moto's S3 server.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from verneuil_fuse.copier import Copier, start_background
from verneuil_fuse.readback import fetch_manifest, restore_bytes
from verneuil_fuse.copier import spool as sp
from verneuil_fuse.store import open_store

from support.copier_support import (WRITER_KINDS, CopierDaemon, Writer, counter_of, store_counter,
                                 wait_for)

VERNEUILCTL = [sys.executable, "-m", "verneuil_fuse.cli"]


@pytest.fixture(params=WRITER_KINDS)
def writer_kind(request):
    return request.param


@pytest.fixture
def spool(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    return str(d)


def spool_bytes(spool: str) -> int:
    return sp.tree_size(spool)[1]


def test_round_trip(any_store, writer_kind, spool, tmp_path, capsys):
    w = Writer(writer_kind, spool, str(tmp_path / "app.db"))
    for _ in range(30):
        w.bump()
    w.execute("CREATE TABLE big(x)")
    w.execute("INSERT INTO big VALUES (randomblob(400000))")
    n = w.bump()
    c = Copier(spool, any_store, rate=0)
    try:
        c.flush(timeout=60)
    finally:
        c.close()
    m = fetch_manifest(any_store, w.name)
    assert restore_bytes(any_store, m) == w.data()
    assert counter_of(w.data(), str(tmp_path)) == n
    # ls and manifest show it
    from verneuil_fuse import cli
    capsys.readouterr()
    assert cli.main(["ls", "--store", any_store.url, "--json"]) == 0
    import json
    listing = json.loads(capsys.readouterr().out)
    (entry,) = [e for e in listing if e["name"] == w.name]
    assert entry["path"] == w.path and entry["size"] == len(w.data())
    assert entry["versions"] >= 1
    assert cli.main(["manifest", "--store", any_store.url, "-s", w.path]) == 0
    out = capsys.readouterr().out
    assert "length:          %d bytes" % len(w.data()) in out
    out_file = tmp_path / "restored.db"
    assert cli.main(["restore", "--store", any_store.url, "-s", w.path, "-o", str(out_file)]) == 0
    assert out_file.read_bytes() == w.data()
    w.close()


@pytest.mark.s3
def test_outage_spool_bounded_and_catch_up(s3_server, writer_kind, spool, tmp_path):
    store = s3_server.make_store()
    w = Writer(writer_kind, spool, str(tmp_path / "app.db"), payload=200)
    bg = start_background(spool, store, rate=0, poll_interval=0.05)
    try:
        for _ in range(20):
            w.bump()
        assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == 20, 20)
        s3_server.stop()
        try:
            biggest = 0
            start = time.monotonic()
            for i in range(1000):
                n = w.bump()
                if i % 50 == 0:
                    biggest = max(biggest, spool_bytes(spool))
            elapsed = time.monotonic() - start
            biggest = max(biggest, spool_bytes(spool))
            db_size = len(w.data())
            # Bounded: a few copies of the database at most (ready + staging).
            assert biggest <= 4 * db_size + 256 * 1024, (biggest, db_size)
            # Commits are not held up by the outage (full speed: 1000 in a few seconds).
            assert elapsed < 60, elapsed
        finally:
            s3_server.start()
        back = time.monotonic()
        assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == n, 30, 0.2)
        catch_up = time.monotonic() - back
        assert catch_up < 20, catch_up
        print("outage: 1000 commits in %.2fs, spool peak %d bytes (db %d), caught up in %.2fs"
              % (elapsed, biggest, db_size, catch_up))
    finally:
        bg.stop()
        w.close()
        store.close()


@pytest.mark.s3
def test_constant_writes_no_livelock_no_deadlock(s3_server, writer_kind, spool, tmp_path):
    store = s3_server.make_store()
    s3_server.latency = 0.005  # uploads slower than commits
    w = Writer(writer_kind, spool, str(tmp_path / "app.db"), payload=20000)
    bg = start_background(spool, store, rate=0, poll_interval=0.05)
    seen = []
    done = threading.Event()

    def write():
        while not done.is_set():
            w.bump()

    t = threading.Thread(target=write, daemon=True)
    try:
        t.start()
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            value = store_counter(store, w.name, str(tmp_path))
            if value is not None and (not seen or value != seen[-1]):
                seen.append(value)
            time.sleep(0.3)
        done.set()
        t.join(30)
        assert not t.is_alive(), "the writer thread did not stop within 30 s of being told to"
        final = counter_of(w.data(), str(tmp_path))
        # No livelock: the store kept receiving newer snapshots while writes went on.
        assert len(seen) >= 3, seen
        assert seen == sorted(seen)
        # No deadlock: once writes stop, the store reaches the final state.
        assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == final, 20, 0.2)
    finally:
        done.set()
        if t.is_alive():
            t.join(30)  # bounded; asserted above when the test got that far
        s3_server.latency = 0
        bg.stop()
        w.close()
        store.close()


class CachingStore:
    """A read-only view of a store that caches chunks (restoring many versions)."""

    def __init__(self, store):
        self.manifests = store.manifests
        self.chunks = self
        self._store = store
        self._cache = {}

    def get(self, key, max_bytes=None):
        if key not in self._cache:
            self._cache[key] = self._store.chunks.get(key, max_bytes)
        return self._cache[key]

    def describe(self):
        return self._store.describe()


@pytest.mark.s3
def test_three_copier_processes_never_go_back_in_time(s3_server, writer_kind, spool, tmp_path):
    store = s3_server.make_store(versioned=True)
    w = Writer(writer_kind, spool, str(tmp_path / "app.db"), payload=1500)
    procs = [subprocess.Popen(VERNEUILCTL + ["copier", "--store", store.url, "--spool", spool,
                                             "--rate", "0", "--poll-interval", "0.02"],
                              stderr=subprocess.PIPE)
             for _ in range(3)]
    try:
        rng = random.Random(4)
        for _ in range(150):
            n = w.bump()
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.02)
        assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == n, 30, 0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(15))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait(30))
    errors = [p.stderr.read().decode() for p in procs]
    assert codes == [0, 0, 0], errors
    assert not any("Traceback" in e for e in errors), errors
    versions = store.manifests.list_versions(w.name)
    assert versions[0].is_latest
    cached = CachingStore(store)
    counters = []
    for v in reversed(versions):  # oldest first
        m = fetch_manifest(cached, w.name, v.version_id)
        counters.append(counter_of(restore_bytes(cached, m), str(tmp_path)))
    assert counters == sorted(counters), counters
    assert counters[-1] == n
    assert len(counters) >= 2
    print("three copiers: %d manifest versions, counters %s..%s"
          % (len(counters), counters[0], counters[-1]))
    w.close()
    store.close()


def test_background_copier_stops_promptly(spool, local_store, tmp_path):
    w = Writer("py", spool, str(tmp_path / "app.db"))
    # An idle wait of 60 s between polls: stop() must interrupt it, not wait
    # for it (the bound below is far under the poll, far over a slow stop).
    bg = start_background(spool, local_store, poll_interval=60)
    try:
        w.bump()
        bg.wake()
        assert wait_for(lambda: store_counter(local_store, w.name, str(tmp_path)) == 1, 10)
        start = time.monotonic()
        assert bg.stop(30)
        assert time.monotonic() - start < 15
        assert not bg.running
    finally:
        bg.stop(10)  # a no-op when the test stopped it already
        w.close()


def test_background_flush_waits_for_everything(spool, local_store, tmp_path):
    w = Writer("py", spool, str(tmp_path / "app.db"))
    try:
        with start_background(spool, local_store, poll_interval=10) as bg:
            for _ in range(5):
                w.bump()
            bg.flush(10)
            assert store_counter(local_store, w.name, str(tmp_path)) == 5
        assert not bg.running
    finally:
        w.close()


def test_sigterm_ends_an_idle_copier_at_once(spool, tmp_path):
    """`verneuilctl copier` waiting out a long poll interval stops as soon as
    it gets SIGTERM, and exits 0 (a service manager's stop)."""
    p = subprocess.Popen(VERNEUILCTL + ["copier", "-v", "--store", "file://%s/store" % tmp_path,
                                        "--spool", spool, "--poll-interval", "60"],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        started = ""
        while "copier started" not in started and time.monotonic() < deadline:
            started = p.stderr.readline()
            assert started or p.poll() is None, "the copier exited before starting"
        assert "copier started" in started
        time.sleep(0.5)  # into its idle wait
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert time.monotonic() - t0 < 5, "the copier waited out its poll interval"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        p.stderr.close()


def test_the_copier_daemon_says_what_it_does(spool, tmp_path):
    """At its default level, `verneuilctl copier` logs its start (spool, store,
    pacing), each database it starts replicating (once, in a short line), the
    signal that stops it and its stop, in words; every line starts with its
    time, the program and its PID. `--pidfile` holds its PID while it runs
    (a second copier with the same pidfile is refused in one line) and goes
    at its stop."""
    import re
    pidfile = str(tmp_path / "copier.pid")
    url = "file://%s/store" % tmp_path
    w = Writer("py", spool, str(tmp_path / "app.db"))
    try:
        with CopierDaemon(spool, url, "--pidfile", pidfile) as daemon:
            daemon.until("copier started")
            with open(pidfile) as f:
                assert f.read() == "%d\n" % daemon.proc.pid
            second = subprocess.run(VERNEUILCTL + ["copier", "--store", url, "--spool", spool, "--pidfile", pidfile],
                                    capture_output=True, text=True, timeout=60)
            assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
            assert "pidfile %s names process %d, which is running" % (pidfile, daemon.proc.pid) in second.stderr
            w.bump()
            w.bump()
            daemon.until("replicating")
            store = open_store(url)
            assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == 2, 20)
            w.bump()
            assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == 3, 20)
            text = daemon.stop()
    finally:
        w.close()
    assert not os.path.exists(pidfile)
    assert "copier started: spool %s -> " % spool in text and "30 requests/s" in text, text
    source = os.path.realpath(str(tmp_path / "app.db"))
    assert text.count("replicating ") == 1 and "replicating %s\n" % source in text, text
    assert re.search(r"got signal 15 \(SIGTERM\), stopping", text), text
    assert re.search(r"copier stopped: \d+ passes, \d+ chunks uploaded", text), text
    for line in text.splitlines():
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d{4} verneuilctl\[%d\] (INFO|WARNING): "
                        % daemon.proc.pid, line), line
        assert "{" not in line and len(line) < 200 + len(spool) + len(url), line
    assert "Traceback" not in text


def _scrape(url: str) -> dict:
    from support.metrics_check import parse, scrape
    return {k: v for k, (_type, v) in parse(scrape(url)).items()}


def test_the_copier_daemon_serves_metrics(spool, tmp_path):
    """`verneuilctl copier --metrics-port 0` logs the address it serves;
    a scrape passes Debian's `promtool check metrics`, parses with
    prometheus_client's parser and carries the copier's counters (the
    numbers it logs at its stop) and the spool's lag per database, labelled
    with the host and source path the mount labels it with; a port in use is
    a one-line error."""
    import re

    from support.metrics_check import promtool_check, promtool_missing, scrape
    from verneuil_fuse.format import local_hostname
    source = os.path.realpath(str(tmp_path / "app.db"))
    db = (("host", local_hostname()), ("path", source))
    url = "file://%s/store" % tmp_path
    w = Writer("py", spool, source)
    try:
        with CopierDaemon(spool, url, "--metrics-port", "0") as daemon:
            metrics_url = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)",
                                    daemon.until("metrics on")).group(1)
            port = int(metrics_url.rsplit(":", 1)[1].split("/")[0])
            for _ in range(3):
                w.bump()
            store = open_store(url)
            assert wait_for(lambda: store_counter(store, w.name, str(tmp_path)) == 3, 20)
            # In sync: nothing pending and no lag, in one scrape (a snapshot
            # whose chunks are shipped has a lag until its directory is gone).
            scrapes = []

            def in_sync() -> bool:
                scrapes.append(_scrape(metrics_url))
                return (scrapes[-1][("verneuil_spool_pending_bytes", db)] == 0
                        and scrapes[-1][("verneuil_spool_lag_seconds", db)] == 0)
            assert wait_for(in_sync, 20), scrapes[-1]
            m = scrapes[-1]
            assert m[("verneuil_copier_manifests_uploaded_total", ())] >= 1
            assert m[("verneuil_copier_passes_total", ())] >= 1
            assert m[("verneuil_spool_wal", db)] == 0
            assert m[("verneuil_spool_snapshotted", db)] == 1
            assert time.time() - 60 < m[("verneuil_copier_last_upload_timestamp_seconds", ())] <= time.time()
            assert any(k[0] == "verneuil_copier_info" and ("spool", spool) in k[1] for k in m), m
            assert any(k[0] == "verneuil_copier_settings_info" and ("rate", "30") in k[1] for k in m), m
            if promtool_missing() is None:
                promtool_check(scrape(metrics_url))
            # A second copier on the same port: a clear error, not a traceback.
            busy = subprocess.run(VERNEUILCTL + ["copier", "--store", url, "--spool", spool,
                                                 "--metrics-port", str(port)],
                                  capture_output=True, text=True, timeout=60)
            assert busy.returncode != 0 and "cannot serve metrics on 127.0.0.1:%d" % port in busy.stderr
            assert "Traceback" not in busy.stderr
            text = daemon.stop()
    finally:
        w.close()
    final = re.search(r"copier stopped: \d+ passes, (\d+) chunks uploaded \(\d+ bytes sent\), (\d+) manifests "
                      r"uploaded, \d+ requests, \d+ errors$", text, re.M)
    assert final, text
    assert int(final.group(2)) == m[("verneuil_copier_manifests_uploaded_total", ())]
    assert int(final.group(1)) == m[("verneuil_copier_chunks_uploaded_total", ())]
