"""verneuil_fuse.metrics: a stats dict in Prometheus' text format, read back
with prometheus_client's own parser (what a Prometheus server accepts)."""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from verneuil_fuse import metrics


def parse(text: bytes) -> dict:
    """{(sample name, frozenset(labels)): (family type, value)}"""
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = (family.type, s.value)
    return out


STATS = {
    "fetch": {"gets": 7, "inflight": 2, "store": {"reachable": False, "last_error": "timeout",
                                                  "unreachable_since": None},
              "disk_cache": {"hits": 3, "bytes": 65536, "writes_paused": True}},
    "refresh": {"polls": 4, "bad_manifests": ["a", "b"], "interval": 1.5},
    "databases": {
        '/web1/data/a "quoted"\\back\nline.db': {"len": 8192, "reads": 5, "version": "ab" * 16,
                                                 "hydration": {"state": "done", "chunks": 1}},
        "/web1/data/b.db": {"len": 4096, "reads": 0, "version": "cd" * 16},
    },
    "mount": {"pid": 42, "source": "s3://x", "ready": True, "cache_dir": None},
}


def render() -> dict:
    return parse(metrics.render(metrics.families(
        "verneuil", STATS, metrics.MOUNT_GAUGES, {"databases": "path"},
        ("mount", {"version": "1.2", "source": 's3://x?a="b"'}))))


def test_counters_gauges_and_labels():
    m = render()
    assert m[("verneuil_fetch_gets_total", frozenset())] == ("counter", 7.0)
    assert m[("verneuil_fetch_inflight", frozenset())] == ("gauge", 2.0)
    assert m[("verneuil_fetch_disk_cache_hits_total", frozenset())] == ("counter", 3.0)
    assert m[("verneuil_fetch_disk_cache_writes_paused", frozenset())] == ("gauge", 1.0)
    assert m[("verneuil_fetch_store_reachable", frozenset())] == ("gauge", 0.0)
    assert m[("verneuil_refresh_bad_manifests", frozenset())] == ("gauge", 2.0)  # a list: its length
    assert m[("verneuil_refresh_interval", frozenset())] == ("gauge", 1.5)
    odd = '/web1/data/a "quoted"\\back\nline.db'
    assert m[("verneuil_databases_len", frozenset({("path", odd)}))] == ("gauge", 8192.0)
    assert m[("verneuil_databases_reads_total", frozenset({("path", "/web1/data/b.db")}))] == ("counter", 0.0)
    assert m[("verneuil_databases_hydration_chunks", frozenset({("path", odd)}))] == ("gauge", 1.0)
    assert m[("verneuil_mount_info", frozenset({("version", "1.2"), ("source", 's3://x?a="b"')}))][1] == 1.0


def test_strings_and_none_are_left_out():
    names = {name for name, _ in render()}
    for left_out in ("verneuil_fetch_store_last_error", "verneuil_fetch_store_unreachable_since",
                     "verneuil_databases_version", "verneuil_databases_hydration_state",
                     "verneuil_mount_source", "verneuil_mount_cache_dir"):
        assert not any(n.startswith(left_out) for n in names), left_out


def numeric_leaves(value, path=()):
    if isinstance(value, (bool, int, float)):
        yield path, float(value)
    elif isinstance(value, list):
        yield path, float(len(value))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from numeric_leaves(v, path + (k,))


def check_same_numbers(stats: dict, text: bytes, gauges: frozenset, labelled: dict) -> int:
    """Every number of `stats` is in `text` with its value; returns how many."""
    m = parse(text)
    seen = 0
    for top, value in stats.items():
        label = labelled.get(top)
        items = value.items() if label else [(None, value)]
        for item, sub in items:
            base = (top,) if label else ()
            for path, number in numeric_leaves(sub, base if label else (top,)):
                dotted = ".".join(path)
                name = "verneuil_" + "_".join(path) + ("" if dotted in gauges else "_total")
                labels = frozenset({(label, item)}) if label else frozenset()
                kind, got = m[(name, labels)]
                assert kind == ("gauge" if dotted in gauges else "counter"), dotted
                assert math.isclose(got, number), (dotted, got, number)
                seen += 1
    return seen


def test_every_number_is_a_series():
    text = metrics.render(metrics.families("verneuil", STATS, metrics.MOUNT_GAUGES, {"databases": "path"}))
    assert check_same_numbers(STATS, text, metrics.MOUNT_GAUGES, {"databases": "path"}) == 16
