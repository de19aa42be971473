"""CI smoke test of the whole-system benchmark: `scripts/bench_all.py --quick`
(small databases, one run each) must finish and write every figure with a
sane value. Every phase but the Spark fan-out runs (`PHASES`): that one is
Spark's start (~20 s) and the tests of verneuil_fuse.spark run the same path;
`make bench-quick` runs it too. Speeds are only checked to be there and positive (a loaded
machine may be slow; the figures themselves are the benchmark's business);
counts (GETs, PUTs, rows, databases) are checked exactly or by their bounds.  About 35 s on 2 cores; it mounts FUSE file systems
(root) and starts moto, nginx, s3fs and rclone, all stopped by the script."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_all.py")

# The script bounds its own phases; this is the outer bound (quick mode
# takes about 35 s here: far more means a phase hangs).
TIMEOUT = 900

pytestmark = [pytest.mark.slow, pytest.mark.fuse, pytest.mark.s3,
              # The module's fixture runs the script: TIMEOUT bounds it, not
              # the suite's default per-test limit.
              pytest.mark.timeout(TIMEOUT + 120)]


def _why_not() -> str | None:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from support.replicas import fuse_unavailable

    reason = fuse_unavailable()
    if reason:
        return reason
    for module in ("moto.server", "pyspark"):
        try:
            __import__(module)
        except ImportError:
            return "%s is not installed" % module
    if shutil.which("java") is None:
        return "no java (Spark)"
    from benchlib import peers

    tools = peers.ensure_tools(lambda msg: None)  # apt-get install s3fs rclone if missing
    from benchlib import nginx_rig

    tools["nginx"] = nginx_rig.ensure_nginx(lambda msg: None)  # and nginx with its echo module
    missing = [name for name, version in tools.items() if version is None]
    if missing:
        return "could not install %s" % ", ".join(missing)
    return None


# The phases CI runs (see the module docstring).
PHASES = ("writer", "lag", "sync", "ceiling", "read", "rig", "storage")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--quick", "--out", str(out),
                             *("--only=%s" % phase for phase in PHASES)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        # SIGINT first: the script's cleanup (unmounts, moto, s3fs, rclone,
        # Spark) runs on KeyboardInterrupt; SIGKILL only if it does not end.
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise AssertionError("bench_all.py --quick took more than %d s" % TIMEOUT) from None
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    with open(out / "results.json") as f:
        return json.load(f), out


def test_every_phase_ran(quick_results):
    r, out = quick_results
    assert r["errors"] == {}
    for phase in PHASES + ("read_rig", "summary"):
        assert phase in r, phase
    assert r["meta"]["mode"] == "quick"
    assert r["meta"]["wall_seconds"] < TIMEOUT
    md = (out / "results.md").read_text()
    assert "| **verneuil mount (this)** |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    for name in ("readers.png", "system.png"):
        assert (out / name).stat().st_size > 10_000, name


def test_rig_figures(quick_results):
    """The readers again against nginx (benchlib/nginx_rig.py): the rig's
    own ceiling from curl, and each reader's cold scan with its GETs; the
    mount's CPU per GET is there."""
    r, _ = quick_results
    ceiling = r["rig"]["ceiling"]
    assert ceiling["GETs_per_s_64"] > 0 and ceiling["whole_object_GET_MBps"] > 0
    systems = r["read_rig"]["systems"]
    assert set(systems) == {"verneuil", "s3fs", "rclone_full", "local"}
    scan = systems["verneuil"]["scan"]
    chunks = r["read_rig"]["db_bytes"] // 65536
    assert chunks - 2 <= scan["gets"] <= chunks + 8  # one GET per chunk, chunk 0 in the manifest
    assert scan["MBps"] > 0 and scan["cpu_ms_per_get"] > 0
    split = scan["cpu_ms_per_get_by_thread"]  # the threads' shares of the process's CPU
    assert split["trio"] > 0 and split["engine"] > 0
    assert sum(split.values()) <= scan["cpu_ms_per_get"] * 1.1 + 0.05
    assert systems["s3fs"]["scan"]["gets"] < scan["gets"]  # ranges, not chunks
    # The engine's side alone: every chunk object, one by one (in C, then
    # in Python), then packed.
    path = r["rig"]["chunk_path"]
    assert chunks - 2 <= path["chunks"] <= chunks + 8
    assert path["engine"]["GETs"] == path["singles"]["GETs"] == path["chunks"]
    assert path["packs"]["GETs"] == -(-path["chunks"] // path["pack_chunks"])
    for run in (path["engine"], path["singles"], path["packs"]):
        assert run["chunks_per_s"] > 0 and run["cpu_ms_per_chunk"] > 0


def test_writer_and_copier_figures(quick_results):
    r, _ = quick_results
    for sync in ("FULL", "OFF"):
        w = r["writer"]["sync"][sync]
        assert w["unix_median_ms"] > 0 and w["verneuil_median_ms"] > 0
        assert w["ratio"] > 0
    lag = r["lag"]
    assert lag["missing"] == 0 and lag["seen"] == lag["commits"] > 0
    assert lag["median_ms"] > 0
    s = r["sync"]
    assert s["copier_MBps"] > 0 and s["plain_upload_MBps"] > 0
    # One PUT per 64 KiB chunk (chunk 0 rides in the manifest), plus the manifest.
    assert s["copier_requests"] >= s["db_bytes"] // 65536 - 1
    assert s["plain_upload_requests"] < s["copier_requests"]
    assert r["ceiling"]["chunk_GETs_per_s"] > 0


def test_reader_comparison(quick_results):
    r, _ = quick_results
    read = r["read"]
    chunks = read["db_bytes"] // 65536
    assert set(read["systems"]) == {"verneuil", "s3fs", "rclone_off", "rclone_full",
                                    "restore", "local"}
    for name, x in read["systems"].items():
        for kind in ("point", "scan", "warm"):
            assert x[kind]["median_s"] > 0, (name, kind, x[kind])
        if name != "local":
            assert x["point"]["gets"] >= 1 and x["scan"]["gets"] >= 1, (name, x)
            assert x["scan"]["bytes_down"] > 0
    v = read["systems"]["verneuil"]
    # Lazy: a point query fetches a few chunks, the scan nearly all of them,
    # and the warm scan comes from the mount's own cache (its only requests
    # may be the follow loop's conditional GETs of the open database's
    # manifest, one per 0.5 s, counted as revalidations).
    assert v["point"]["gets"] <= 16 < chunks // 2 <= v["scan"]["gets"] <= chunks + 2
    assert v["warm"]["gets"] == 0
    assert read["systems"]["restore"]["point"]["gets"] >= chunks - 1


def test_storage_and_summary(quick_results):
    r, _ = quick_results
    assert "fanout" not in r
    st = r["storage"]
    assert 0 < st["dedup"]["ratio"] < 0.6
    assert 0 < st["sync_db"]["ratio"] < 1.2
    summary = r["summary"]
    for key in ("writer_commit_ratio_full", "lag_median_ms", "sync_copier_vs_plain",
                "scan_s3fs_vs_verneuil", "point_rclone_full_vs_verneuil", "dedup_stored_ratio"):
        assert summary.get(key) is not None and summary[key] > 0, key
