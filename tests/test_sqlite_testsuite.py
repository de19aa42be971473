"""SQLite's own TCL regression suite with `verneuil` as the default VFS.

Runs the CI subset (scripts/sqlite_testsuite/ci-subset.txt) through
scripts/sqlite-testsuite.sh: Debian's source package of the installed
SQLite, a `testfixture` with csrc/ compiled in and registered as the default
VFS, and the self-check after every write transaction (the staged snapshot
rebuilt and compared with the database).  See docs/SQLITE_TESTSUITE.md.

Skips only when the source package cannot be fetched (exit status 3); any
failing test file, self-check mismatch or build failure fails.  The
testfixture build is cached under ~/.cache/verneuil/sqlite-src (or
$VERNEUIL_SQLITE_CACHE), keyed by the C sources.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "sqlite-testsuite.sh"

# Setup (fetch + build, ~3 min on a fresh machine) + the subset (~3-4 min).
BUDGET_SECONDS = 1500

pytestmark = pytest.mark.slow


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


@pytest.mark.timeout(BUDGET_SECONDS + 60)
def test_sqlite_tcl_suite_ci_subset(tmp_path):
    if shutil.which("apt-get") is None or shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian system: cannot fetch SQLite's source package")
    out = tmp_path / "results"
    env = dict(os.environ)
    env.pop("VERNEUIL_CONFIG", None)
    try:
        proc = subprocess.run(
            ["bash", str(SCRIPT), "--ci", "--out", str(out)],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=BUDGET_SECONDS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"sqlite-testsuite.sh --ci exceeded {BUDGET_SECONDS}s:\n"
                    f"{_tail((e.stdout or b'').decode(errors='replace'))}")
    output = proc.stdout + "\n" + proc.stderr
    if proc.returncode == 3:
        pytest.skip("SQLite's source package could not be fetched: "
                    + _tail(proc.stderr, 5))
    assert proc.returncode == 0, (
        f"sqlite-testsuite.sh --ci exited {proc.returncode}:\n{_tail(output)}")

    summary = json.loads((out / "summary.json").read_text())
    print(_tail(proc.stdout, 8))
    # The subset really ran, and really checked commits.
    assert summary["files_run"] >= 20, summary
    assert summary["files_failed"] == 0, summary["failed_files"]
    assert summary["tests_run"] > 10000, summary
    assert summary["tests_failed"] == 0, summary
    sc = summary["selfcheck_totals"]
    assert sc["mismatch"] == 0 and sc["error"] == 0, sc
    assert sc["ok"] > 1000, sc
    assert summary["vfs"] == "verneuil" and summary["selfcheck"] is True
