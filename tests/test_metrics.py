"""verneuil_fuse.metrics: the series tables follow Prometheus' naming rules,
a stats dict renders to text that Prometheus' own linter (Debian's
`promtool check metrics`) and prometheus_client's parser accept, integers
are printed exactly, databases are labelled by host and source path, and
the HTTP endpoint serves it."""
from __future__ import annotations

import re
import socket
import urllib.error
import urllib.request

import pytest

from support.metrics_check import parse, promtool_check, promtool_missing, scrape, unlisted
from verneuil_fuse import metrics
from verneuil_fuse.format import manifest_name

KEY = manifest_name('/srv/data/a "quoted"\\back\nline.db', "web1")
LONG_KEY = manifest_name("/srv/" + "d" * 120 + "/" + "e" * 120 + "/tail.db", "web2")
STATS = {
    "fetch": {"gets": 7, "get_bytes": (1 << 62) + 1, "inflight": 2, "prefetch_waste": 0,
              "store": {"reachable": False, "last_error": "timeout", "unreachable_since": 1795823192.25,
                        "deadline": 30.0, "max_db_size": 64 << 30},
              "disk_cache": {"hits": 3, "bytes": 65536, "limit": 2 << 30, "writes_paused": True}},
    "refresh": {"polls": 4, "bad_manifests": ["a", "b"], "interval": 1.5, "last_poll": 0.0},
    "catalog": {"databases": 2, "decoded_limit": 256},
    "databases": {
        "/web1/srv/data/a.db": {"key": KEY, "len": 8192, "mtime_ns": 1795823192772518123, "inode": 9,
                                "reads": 1, "since_mount": {"reads": 5, "opens": 3},
                                "hydration": {"state": "done", "chunks": 1}},
        "/web2/long.db": {"key": LONG_KEY, "len": 4096, "since_mount": {"reads": 0}},
    },
    "mount": {"pid": 42, "source": "s3://x", "ready": True, "cache_dir": None},
}
LABELS = {"databases": lambda path, d: metrics.database_labels(d["key"], path)}


def rendered() -> bytes:
    info = metrics.info_family("verneuil_mount_info", "what this mount is",
                               {"version": "1.2", "source": 's3://x?a="b"', "pid": 42, "cache_dir": None})
    return metrics.render([info] + metrics.families(STATS, metrics.MOUNT_SERIES, LABELS))


def test_series_names_follow_prometheus_rules():
    names = set()
    for s in metrics.MOUNT_SERIES + metrics.COPIER_SERIES:
        if s.kind == metrics.LEFT_OUT:
            assert not s.name and s.help, s
            continue
        assert s.name not in names, s.name
        names.add(s.name)
        assert re.fullmatch(r"verneuil_[a-z][a-z0-9_]*[a-z0-9]", s.name), s.name
        assert s.name.endswith("_total") == (s.kind == metrics.COUNTER), s.name
        assert s.name.endswith("_timestamp_seconds") == (s.kind == metrics.TIMESTAMP), s.name
        assert not re.search(r"_(ns|ms|us|kb|mb|gb|secs?|sec|info)(_|$)", s.name), s.name
        assert s.help and s.help[0].isalnum(), s
        key = s.path.split(".")[-1]
        if key in ("lag", "age", "interval", "deadline", "unreachable_since", "mtime_ns", "last_poll",
                   "last_upload", "started"):
            assert s.name.endswith("_seconds"), s.name
        if set(key.split("_")) & {"bytes", "size", "len"}:
            assert s.name.endswith(("_bytes", "_bytes_total")), s.name


def test_values_types_and_labels():
    m = parse(rendered())
    web1 = (("host", "web1"), ("path", '/srv/data/a "quoted"\\back\nline.db'))
    assert m[("verneuil_fetch_gets_total", ())] == ("counter", 7)
    assert m[("verneuil_fetch_inflight", ())] == ("gauge", 2)
    assert m[("verneuil_fetch_disk_cache_hits_total", ())] == ("counter", 3)
    assert m[("verneuil_fetch_disk_cache_writes_paused", ())] == ("gauge", 1)
    assert m[("verneuil_fetch_store_reachable", ())] == ("gauge", 0)
    assert m[("verneuil_refresh_bad_manifests", ())] == ("gauge", 2)  # a list: its length
    assert m[("verneuil_catalog_databases", ())] == ("gauge", 2)
    assert m[("verneuil_database_size_bytes", web1)] == ("gauge", 8192)
    assert m[("verneuil_database_reads_total", web1)] == ("counter", 5)
    assert m[("verneuil_database_opens_total", web1)] == ("counter", 3)
    assert m[("verneuil_database_hydration_chunks", web1)] == ("gauge", 1)
    assert m[("verneuil_fetch_store_unreachable_since_timestamp_seconds", ())] == ("gauge", 1795823192.25)
    mtime = m[("verneuil_database_mtime_timestamp_seconds", web1)][1]
    assert abs(mtime - 1795823192.772518123) < 1e-6  # nanoseconds to seconds
    info = [k for k in m if k[0] == "verneuil_mount_info"]
    assert info == [("verneuil_mount_info", (("pid", "42"), ("source", 's3://x?a="b"'), ("version", "1.2")))]
    # The mangled key: its host, and its path's kept ends around the mark.
    long_labels = metrics.database_labels(LONG_KEY)
    assert long_labels["host"] == "web2" and "\u2026" in long_labels["path"]
    assert long_labels["path"].startswith("/srv/ddd") and long_labels["path"].endswith("/tail.db")
    assert ("verneuil_database_size_bytes", tuple(sorted(long_labels.items()))) in m


def test_settings_identifiers_strings_and_never_are_not_series():
    names = {name for name, _ in parse(rendered())}
    for left_out in ("verneuil_fetch_store_last_error", "verneuil_fetch_store_deadline",
                     "verneuil_fetch_disk_cache_limit", "verneuil_refresh_interval",
                     "verneuil_catalog_decoded_limit", "verneuil_database_inode", "verneuil_mount_pid",
                     "verneuil_refresh_last_poll_timestamp_seconds"):  # 0: never polled
        assert not any(n.startswith(left_out) for n in names), left_out


def test_integers_are_printed_exactly():
    text = rendered().decode()
    assert "verneuil_fetch_get_bytes_total %d\n" % ((1 << 62) + 1) in text
    assert "verneuil_fetch_gets_total 7\n" in text
    assert re.search(r"^verneuil_database_size_bytes\{.*\} 8192$", text, re.M)
    assert ".0\n" not in text and "e+" not in text


def test_every_number_of_the_stats_is_accounted_for():
    assert unlisted(STATS, metrics.MOUNT_SERIES, ("databases",)) == []
    assert unlisted({"fetch": {"new_counter": 1}}, metrics.MOUNT_SERIES, ()) == ["fetch.new_counter"]


@pytest.mark.skipif(promtool_missing() is not None, reason=promtool_missing() or "")
def test_promtool_accepts_the_rendering():
    promtool_check(rendered())
    # And rejects what the names were before (a time in ns, a setting as a counter).
    bad = metrics.render([metrics.Family("verneuil_databases_mtime_ns", "gauge", "x", [({}, 1)])])
    with pytest.raises(AssertionError, match="abbreviated units"):
        promtool_check(bad)


def test_the_http_endpoint():
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the catalog is gone")
        return rendered()

    server = metrics.MetricsServer(render, 0)
    try:
        assert server.url == "http://127.0.0.1:%d/metrics" % server.port
        assert scrape(server.url) == rendered()
        assert scrape(server.url.replace("/metrics", "/")) == rendered()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url, timeout=10)
        assert err.value.code == 503 and b"the catalog is gone" in err.value.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=10)
        assert err.value.code == 404
        with pytest.raises(OSError):  # the port is taken
            metrics.MetricsServer(render, server.port)
    finally:
        server.close()
    with pytest.raises(OSError):  # closed: nothing answers
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
