"""Checks shared by the metrics tests: Debian's `promtool check metrics` on
a scrape, the scrape read back with prometheus_client's parser, and the
numbers of a stats dict that no `metrics.Series` accounts for."""
from __future__ import annotations

import shutil
import subprocess
import urllib.request

from verneuil_fuse import metrics

PROMTOOL = "promtool"


def promtool_missing() -> str | None:
    """Why `promtool check metrics` cannot run here (None if it can)."""
    if shutil.which(PROMTOOL) is None:
        return "no promtool (Debian's prometheus package; scripts/setup.sh installs it)"
    return None


def promtool_check(text: bytes) -> None:
    """Fail unless `promtool check metrics` (Prometheus' own linter: types,
    suffixes, units, help) finds nothing to say about `text`."""
    proc = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, timeout=60)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0 and not out.strip(), "promtool check metrics:\n" + out


def parse(text: bytes | str) -> dict:
    """{(sample name, sorted label pairs): (family type, value)}"""
    from prometheus_client.parser import text_string_to_metric_families

    if isinstance(text, bytes):
        text = text.decode()
    return {(s.name, tuple(sorted(s.labels.items()))): (family.type, s.value)
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"] == metrics.CONTENT_TYPE, r.headers["Content-Type"]
        return r.read()


def unlisted(stats: dict, table, labelled: tuple[str, ...]) -> list[str]:
    """Dotted paths of the numbers in `stats` that `table` does not list
    (a labelled section's item keys left out of the path)."""
    listed = {s.path for s in table}
    missing = set()
    for top, value in stats.items():
        items = value.values() if top in labelled and isinstance(value, dict) else [value]
        for item in items:
            for path, _ in metrics.numeric_leaves(item, (top,)):
                if ".".join(path) not in listed:
                    missing.add(".".join(path))
    return sorted(missing)
