"""verneuilctl against a store someone hostile can write: manifests that
declare a huge database, a zstd bomb, an object of 200 MB, and a chunk object
of a valid frame plus 200 MB of trailing bytes.  `restore`, `manifest` and
`ls` (the real program, in a subprocess) must fail (or warn) with one line,
no traceback, and a bounded peak RSS."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from verneuil_fuse import format as fmt
from verneuil_fuse.store import open_store

from support.replicas import HOST, publish
from test_cli import assert_one_line_error
from test_format_manifest import zstd_bomb

# Size of the oversized objects: far above any bound (the manifest limit is
# ~18 MiB, a chunk's 65 KiB), written sparse so the test costs no disk.
HOSTILE_BYTES = 200 << 20

# Peak RSS allowed to one verneuilctl run: the interpreter, its imports and
# an 18 MiB manifest fit with room to spare; reading any hostile object whole
# (200 MB, or the bomb's 400 MB) would not.
MAX_RSS = 300 << 20

# Seconds before a verneuilctl run that hangs is stopped (the test fails).
RUN_TIMEOUT = 120


def _manifest_path(root: str, key: str) -> str:
    return os.path.join(root, "manifests", key)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A directory store with one good replica and the hostile objects;
    returns (url, {case: manifest name}, good data, bad chunk name)."""
    root = str(tmp_path_factory.mktemp("hostile") / "store")
    store = open_store("file://" + root)
    rng = random.Random(7)
    names = {}
    good = rng.randbytes(3 * fmt.CHUNK_SIZE + 123)
    names["ok"] = publish(store, good, "/bounds/ok.db").key

    # A manifest declaring 1 PiB with one chunk: refused on its len.
    pub = publish(store, rng.randbytes(1000), "/bounds/declares.db")
    from verneuil_fuse.format import manifest_pb2
    top = manifest_pb2.Manifest.FromString(fmt.encode_manifest(pub.manifest))
    top.v1.len = 1 << 50
    store.manifests.put(pub.key, fmt.compress_manifest(top.SerializeToString()))
    names["declares"] = pub.key

    # 25 million zero chunks in a ~12 KB frame.
    names["bomb"] = fmt.manifest_name("/bounds/bomb.db", HOST)
    store.manifests.put(names["bomb"], zstd_bomb(25_000_000))

    # A 200 MB manifest object (sparse).
    names["huge"] = fmt.manifest_name("/bounds/huge.db", HOST)
    store.manifests.put(names["huge"], fmt.compress_manifest(fmt.encode_manifest(pub.manifest)))
    os.truncate(_manifest_path(root, names["huge"]), HOSTILE_BYTES)

    # A replica whose chunk 1 is a valid frame followed by 200 MB (sparse).
    pub = publish(store, rng.randbytes(3 * fmt.CHUNK_SIZE), "/bounds/chunk.db")
    names["chunk"] = pub.key
    bad = pub.manifest.chunks[1].name
    os.truncate(os.path.join(root, "chunks", bad), HOSTILE_BYTES)
    store.close()
    return "file://" + root, names, good, bad


# `python -m verneuil_fuse.cli ARGS`, reporting the process's own peak RSS
# (VmHWM, in KiB) into the file named by its first argument.  Measured
# inside: the rusage of a child also counts its parent's peak (the memory
# the child shared before its exec).
_MEASURED = """
import runpy, sys
out = sys.argv.pop(1)
try:
    runpy.run_module("verneuil_fuse.cli", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as status:
        peak = [line.split()[1] for line in status if line.startswith("VmHWM:")]
    with open(out, "w") as f:
        f.write(peak[0])
"""


def run_measured(args, tmp_path):
    """Run verneuilctl; (CompletedProcess, peak RSS in bytes)."""
    env = dict(os.environ)
    env.pop("VERNEUIL_CONFIG", None)
    hwm = tmp_path / "hwm"
    proc = subprocess.run([sys.executable, "-c", _MEASURED, str(hwm)] + args,
                          capture_output=True, env=env, timeout=RUN_TIMEOUT)
    return proc, int(hwm.read_text()) << 10


# What the one error line says for each hostile manifest.
MANIFEST_CASES = {
    "declares": ("larger than the 64 GiB limit", "max_db_size", "--max-db-size"),
    "bomb": ("decompresses past", "max_db_size", "--max-db-size"),
    "huge": ("%d bytes" % HOSTILE_BYTES, "max_db_size", "--max-db-size"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_manifest_refuses_hostile_manifests(hostile, case, tmp_path):
    url, names, _, _ = hostile
    proc, rss = run_measured(["manifest", "--store", url, "-m", names[case]], tmp_path)
    assert_one_line_error(proc, names[case], *MANIFEST_CASES[case])
    assert proc.returncode == 1
    assert rss < MAX_RSS, rss


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_restore_refuses_hostile_manifests(hostile, case, tmp_path):
    url, names, _, _ = hostile
    out = tmp_path / "out.db"
    proc, rss = run_measured(["restore", "--store", url, "-m", names[case], "-o", str(out)],
                             tmp_path)
    assert_one_line_error(proc, *MANIFEST_CASES[case])
    assert not out.exists() and os.listdir(tmp_path) == ["hwm"]
    assert rss < MAX_RSS, rss


def test_restore_refuses_a_hostile_chunk(hostile, tmp_path):
    url, names, _, bad = hostile
    out = tmp_path / "out.db"
    proc, rss = run_measured(["restore", "--store", url, "-m", names["chunk"], "-o", str(out)],
                             tmp_path)
    assert_one_line_error(proc, bad, "%d bytes" % HOSTILE_BYTES, str(fmt.MAX_CHUNK_BLOB_BYTES))
    assert not out.exists()
    assert rss < MAX_RSS, rss
    # Its manifest is fine: `manifest` does not fetch chunks.
    proc, _ = run_measured(["manifest", "--store", url, "-m", names["chunk"]], tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_good_replica_still_restores(hostile, tmp_path):
    url, names, good, _ = hostile
    proc, rss = run_measured(["restore", "--store", url, "-m", names["ok"], "-o", "-"], tmp_path)
    assert proc.returncode == 0 and proc.stdout == good, proc.stderr
    assert rss < MAX_RSS, rss


def test_ls_warns_about_each_hostile_manifest(hostile, tmp_path):
    url, names, good, _ = hostile
    proc, rss = run_measured(["ls", "--store", url], tmp_path)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr.decode()
    assert "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert sorted(w.split(":", 2)[1].strip() for w in warnings) == sorted(
        names[c] for c in MANIFEST_CASES), err
    assert "/bounds/ok.db" in proc.stdout.decode()
    assert rss < MAX_RSS, rss


def test_max_db_size_option(hostile, tmp_path):
    url, names, good, _ = hostile
    base = ["manifest", "--store", url, "-m", names["ok"]]
    proc, _ = run_measured(base + ["--max-db-size", "100K"], tmp_path)
    assert_one_line_error(proc, "larger than the 100 KiB limit", "--max-db-size")
    proc, _ = run_measured(base + ["--max-db-size", "1M"], tmp_path)
    assert proc.returncode == 0 and str(len(good)) in proc.stdout.decode(), proc.stderr
    # The declared 1 PiB passes the size rule once the limit allows it (and
    # then fails on its chunk count, as any inconsistent manifest does).
    proc, _ = run_measured(["manifest", "--store", url, "-m", names["declares"],
                            "--max-db-size", "2P"], tmp_path)
    assert_one_line_error(proc, "corrupt manifest", "(length)")
    proc, _ = run_measured(["restore", "--store", url, "-m", names["ok"], "-o", "-",
                            "--max-db-size", "banana"], tmp_path)
    assert proc.returncode == 2 and b"Traceback" not in proc.stderr
    assert b"is not a size" in proc.stderr


def test_manifest_file_is_read_bounded(hostile, tmp_path):
    url, names, _, _ = hostile
    path = _manifest_path(url[len("file://"):], names["huge"])
    proc, rss = run_measured(["manifest", "--manifest-file", path], tmp_path)
    assert_one_line_error(proc, "manifest file", "--max-db-size")
    assert rss < MAX_RSS, rss


def test_a_base_chunk_as_long_as_a_large_list(tmp_path):
    """Verneuil's base chunks are as long as the chunk list (over 64 KiB for
    a database over 256 MiB): `manifest` decodes such a manifest and
    `restore` writes the right bytes."""
    from support.replicas import publish_large_base
    url = "file://%s/store" % tmp_path
    store = open_store(url)
    manifest, real, size = publish_large_base(store, "/large-based.db", hostname=HOST)
    store.close()
    proc = subprocess.run([sys.executable, "-m", "verneuil_fuse.cli", "manifest", "--json", "--store", url,
                           "--hostname", HOST, "-s", "/large-based.db"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    import json
    assert len(json.loads(proc.stdout)["chunks"]) == len(manifest.chunks)
    out = tmp_path / "restored.db"
    proc = subprocess.run([sys.executable, "-m", "verneuil_fuse.cli", "restore", "-q", "--store", url,
                           "--hostname", HOST, "-s", "/large-based.db", "-o", str(out)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    n = len(manifest.chunks)
    with open(out, "rb") as f:
        assert os.fstat(f.fileno()).st_size == size
        assert f.read(fmt.CHUNK_SIZE) == real[0]
        f.seek(2000 * fmt.CHUNK_SIZE)
        assert f.read(fmt.CHUNK_SIZE) == bytes(fmt.CHUNK_SIZE)
        f.seek((n - 2) * fmt.CHUNK_SIZE)
        assert f.read() == real[n - 2] + real[n - 1]
