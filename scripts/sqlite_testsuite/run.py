#!/usr/bin/env python3
"""Runs SQLite TCL test files with a testfixture built by sqlite-testsuite.sh.

Each test file runs in its own process and scratch directory, the way
SQLite's permutations.test runs a suite (`testfixture permutations.test
SUITE FILE`: quick mode, same set-up), with its own spool directory, under a
time limit, two at a time; as root, as `nobody` (see Stage).  The verneuil
self-check (testfixture_init.c) logs every mismatch to a per-file log.
Results go to OUT/summary.{txt,json} and OUT/logs/.

A file fails when testfixture exits non-zero, prints no summary line (a
crash), reports a failed test, unfreed memory or leaked files, times out, or
when the self-check saw a mismatch or could not check.  With --baseline,
failed files run again on the plain unix VFS, and identical failures are
reported as `baseline` and do not fail the run.  Exit status: 0 when no file
failed, 1 otherwise, 2 on a usage error, 130 when interrupted.  Standard
library only.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUMMARY_RE = re.compile(r"^(\d+) errors out of (\d+) tests", re.M)
FAILURES_RE = re.compile(r"^!Failures on these tests:(.*)$", re.M)
SELFCHECK_SUMMARY_RE = re.compile(
    r"^VERNEUIL-SELFCHECK SUMMARY pid=\d+ (.*)$", re.M)
SELFCHECK_PROBLEM_RE = re.compile(
    r"^VERNEUIL-SELFCHECK (MISMATCH|ERROR) .*$", re.M)
SELFCHECK_KEYS = ("checked", "ok", "empty", "wal", "busy", "unreadable", "hot", "replaced",
                  "faults", "unreplicated", "mismatch", "error")


@dataclass
class Exclusion:
    pattern: str
    category: str
    reason: str


@dataclass
class FileResult:
    name: str
    # passed | failed | timeout | crashed | not run | baseline (failed the
    # same way with the plain unix VFS)
    status: str = "not run"
    tests: int = 0
    errors: int = 0
    seconds: float = 0.0
    exit_code: int | None = None
    failed_tests: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    selfcheck: dict[str, int] = field(default_factory=dict)
    selfcheck_problems: list[str] = field(default_factory=list)
    baseline: dict | None = None  # the plain unix VFS's result (--baseline)


def read_list(path: Path) -> list[str]:
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


def read_exclusions(path: Path) -> list[Exclusion]:
    """Lines `PATTERN  CATEGORY: reason`; `#` starts a comment line."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or ":" not in parts[1]:
            raise SystemExit(f"{path}:{n}: expected 'PATTERN CATEGORY: reason'")
        category, reason = parts[1].split(":", 1)
        out.append(Exclusion(parts[0], category.strip(), reason.strip()))
    return out


def expand_list(entries: list[str], testdir: Path) -> list[str]:
    """A list file's entries in order: NAME, a glob on test/*.test (e.g.
    `insert*.test`), or `-NAME`/`-GLOB` to drop what earlier lines added."""
    names: list[str] = []
    for e in entries:
        drop = e.startswith("-")
        pat = e[1:] if drop else e
        if any(c in pat for c in "*?["):
            hits = sorted(p.name for p in testdir.glob(pat))
            if not hits:
                raise SystemExit(f"list entry {e!r} matches no test file")
        else:
            hits = [pat]
        if drop:
            names = [n for n in names if n not in hits]
        else:
            names.extend(h for h in hits if h not in names)
    return names


def suite_files(testfixture: Path, testdir: Path, suite: str) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="vn-sqlite-list-") as tmp:
        env = dict(os.environ, VERNEUIL_TESTFIXTURE_VFS="unix")
        proc = subprocess.run(
            [str(testfixture), str(HERE / "list_suite.tcl"), str(testdir),
             suite], cwd=tmp, env=env, capture_output=True, text=True,
            timeout=120, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"listing suite {suite} failed: {proc.stderr}")
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def resolve(testdir: Path, name: str) -> Path | None:
    """A name from a list: a path, a bare file in test/, or a file in ext/."""
    p = Path(name)
    if p.is_absolute() and p.exists():
        return p.resolve()
    if (testdir / name).exists():
        return (testdir / name).resolve()
    hits = sorted((testdir.parent / "ext").glob(f"**/{p.name}"))
    return hits[0].resolve() if hits else None


def excluded_by(name: str, exclusions: list[Exclusion]) -> Exclusion | None:
    for ex in exclusions:
        if fnmatch.fnmatchcase(name, ex.pattern):
            return ex
    return None


# Set on SIGINT/SIGTERM: no new file starts, running ones are killed.
STOP = threading.Event()
RUNNING: set[subprocess.Popen] = set()
RUNNING_LOCK = threading.Lock()


def stop_all(signum=None, frame=None) -> None:
    STOP.set()
    with RUNNING_LOCK:
        for proc in list(RUNNING):
            kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Stage:
    """Where test files run from.  As root, SQLite's permission tests
    (read-only files and directories) cannot work ("Tests do not work when
    run as root"), so the runner drops to `nobody`; nobody cannot read a
    cache under /root, so testfixture and the test scripts are copied to a
    world-readable directory first."""

    def __init__(self, testfixture: Path, srcdir: Path, as_user: str | None):
        self.user = None
        self.tmp = None
        self.testfixture = testfixture
        self.testdir = srcdir / "test"
        self.work_root: Path | None = None
        if as_user is None:
            return
        import pwd
        pw = pwd.getpwnam(as_user)
        self.user, self.uid, self.gid = as_user, pw.pw_uid, pw.pw_gid
        self.tmp = Path(tempfile.mkdtemp(prefix="verneuil-sqlite-"))
        self.tmp.chmod(0o755)
        shutil.copy2(testfixture, self.tmp / "testfixture")
        (self.tmp / "testfixture").chmod(0o755)
        src = self.tmp / "src"
        for sub in ("test", "ext", "tool", "src"):
            if (srcdir / sub).is_dir():
                shutil.copytree(srcdir / sub, src / sub, symlinks=True)
        for d, _, files in os.walk(src):
            os.chmod(d, 0o755)
            for f in files:
                fp = os.path.join(d, f)
                if not os.path.islink(fp):
                    os.chmod(fp, 0o755 if os.access(fp, os.X_OK) else 0o644)
        self.testfixture = self.tmp / "testfixture"
        self.testdir = src / "test"
        self.work_root = self.tmp / "work"
        self.work_root.mkdir()
        self.work_root.chmod(0o755)

    def popen_kwargs(self) -> dict:
        if self.user is None:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def chown_tree(self, path: Path) -> None:
        if self.user is None:
            return
        for d, dirs, files in os.walk(path):
            os.chown(d, self.uid, self.gid)
            for f in files:
                os.chown(os.path.join(d, f), self.uid, self.gid)

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def run_one(args, stage: Stage, path: Path, out: Path, vfs: str,
            selfcheck: bool, log_suffix: str = "") -> FileResult:
    name = path.name
    res = FileResult(name=name)
    logs = out / "logs"
    work = Path(tempfile.mkdtemp(prefix=f"{name}.",
                                 dir=stage.work_root or out / "work"))
    log_path = logs / f"{name}{log_suffix}.log"
    selfcheck_log = work / "selfcheck.log"
    env = dict(os.environ)
    env.update(
        VERNEUIL_TESTFIXTURE_VFS=vfs,
        VERNEUIL_TESTFIXTURE_SPOOL=str(work / "spool"),
        VERNEUIL_SELFCHECK="1" if selfcheck else "0",
        VERNEUIL_SELFCHECK_LOG=str(selfcheck_log),
        TMPDIR=str(work),
        HOME=str(work),
    )
    if stage.user is not None:
        env.update(USER=stage.user, LOGNAME=stage.user)
    env.pop("VERNEUIL_CONFIG", None)
    (work / "run").mkdir()
    stage.chown_tree(work)
    # The file is named by its tail: permutations.test finds it in test/ or
    # ext/ (and runs it with the suite's settings).
    cmd = [str(stage.testfixture), str(stage.testdir / "permutations.test"),
           args.mode_suite, name]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=work / "run", env=env,
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                start_new_session=True,
                                **stage.popen_kwargs())
        with RUNNING_LOCK:
            RUNNING.add(proc)
        try:
            res.exit_code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            proc.wait()
            res.status = "timeout"
            res.notes.append(f"killed after {args.timeout} s")
        finally:
            # Children that outlived testfixture (tests start helpers).
            kill_group(proc)
            with RUNNING_LOCK:
                RUNNING.discard(proc)
    res.seconds = round(time.monotonic() - start, 2)
    text = log_path.read_text(errors="replace")
    sums = SUMMARY_RE.findall(text)
    if sums:
        res.errors, res.tests = int(sums[-1][0]), int(sums[-1][1])
    fails = FAILURES_RE.findall(text)
    if fails:
        res.failed_tests = fails[-1].split()
    for marker in ("Unfreed memory", "files were left open"):
        if marker in text:
            res.notes.append(marker)
    if selfcheck_log.exists():
        sc = selfcheck_log.read_text(errors="replace")
        (logs / f"{name}{log_suffix}.selfcheck").write_text(sc)
        totals = dict.fromkeys(SELFCHECK_KEYS, 0)
        for fields in SELFCHECK_SUMMARY_RE.findall(sc):
            for kv in fields.split():
                k, _, v = kv.partition("=")
                if k in totals:
                    totals[k] += int(v)
        res.selfcheck = totals
        res.selfcheck_problems = [
            m.group(0) for m in SELFCHECK_PROBLEM_RE.finditer(sc)][:20]
    if res.status != "timeout":
        if not sums:
            res.status = "crashed"
            res.notes.append(f"no summary line; exit code {res.exit_code}")
        elif res.errors or res.exit_code != 0 or res.selfcheck_problems:
            res.status = "failed"
        else:
            res.status = "passed"
    if res.selfcheck_problems:
        res.notes.append(f"{len(res.selfcheck_problems)} self-check problem(s)")
    shutil.rmtree(work, ignore_errors=True)
    return res


def run_pool(args, stage: Stage, files: list[Path], out: Path, vfs: str,
             selfcheck: bool, started: float, log_suffix: str = "",
             verbose: bool = True) -> dict[str, FileResult]:
    results = {p.name: FileResult(name=p.name) for p in files}
    done = 0

    def job(p: Path) -> FileResult:
        if STOP.is_set():
            r = FileResult(name=p.name)
            r.notes.append("interrupted")
            return r
        if args.budget and time.monotonic() - started > args.budget:
            r = FileResult(name=p.name)
            r.notes.append("budget exhausted")
            return r
        return run_one(args, stage, p, out, vfs, selfcheck, log_suffix)

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futs = [pool.submit(job, p) for p in files]
        for fut in concurrent.futures.as_completed(futs):
            r = fut.result()
            results[r.name] = r
            done += 1
            if r.status == "not run" or not verbose:
                continue
            sc = ""
            if r.selfcheck:
                sc = (f" selfcheck ok={r.selfcheck['ok']}"
                      f" mismatch={r.selfcheck['mismatch']}")
            print(f"[{done}/{len(files)}] {r.status:7s} {r.name}: "
                  f"{r.errors} errors out of {r.tests} tests "
                  f"({r.seconds:.1f}s){sc}"
                  + (f" [{'; '.join(r.notes)}]" if r.notes else ""),
                  flush=True)
            if r.status != "passed":
                if r.failed_tests:
                    print(f"    failed: {' '.join(r.failed_tests[:20])}",
                          flush=True)
                for line in r.selfcheck_problems[:3]:
                    print(f"    {line}", flush=True)
    return results


def classify_baseline(r: FileResult, u: FileResult) -> None:
    """r failed with verneuil; u is the same file with the plain unix VFS.
    Identical failures (same failed tests, or both crashed) and no
    self-check problem: the environment's, not the VFS's."""
    r.baseline = {"status": u.status, "failed_tests": u.failed_tests,
                  "errors": u.errors, "tests": u.tests}
    if r.selfcheck_problems or u.status == "passed":
        return
    if r.status == "crashed" and u.status == "crashed":
        r.status = "baseline"
    elif r.status == "failed" and u.status == "failed" and \
            set(r.failed_tests) <= set(u.failed_tests) and \
            (r.failed_tests or not u.failed_tests):
        r.status = "baseline"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--testfixture", type=Path, required=True)
    ap.add_argument("--srcdir", type=Path, required=True)
    ap.add_argument("--exclusions", type=Path, required=True)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--suite")
    src.add_argument("--list", type=Path)
    src.add_argument("--files", nargs="+")
    ap.add_argument("--within", metavar="SUITE",
                    help="with --list: keep only files of this suite")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--budget", type=float, default=0,
                    help="stop starting files after this many seconds")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vfs", choices=("verneuil", "unix"), default="verneuil")
    ap.add_argument("--selfcheck", action="store_true")
    ap.add_argument("--baseline", action="store_true",
                    help="re-run failed files with the plain unix VFS; "
                    "failures it reproduces are the environment's and do "
                    "not fail the run")
    ap.add_argument("--as-user", default="auto",
                    help="run testfixture as this user (default: nobody "
                    "when run as root; 'none' to keep root)")
    args = ap.parse_args()

    srcdir = args.srcdir.resolve()
    testdir = srcdir / "test"
    args.testfixture = args.testfixture.resolve()
    # How each file is run: the suite's settings (quick mode for veryquick
    # and quick; `full` runs the long variants).
    args.mode_suite = args.suite if args.suite in ("quick", "full") else "veryquick"
    exclusions = read_exclusions(args.exclusions)
    if args.suite:
        names = suite_files(args.testfixture, testdir, args.suite)
    elif args.list:
        names = expand_list(read_list(args.list), testdir)
        if args.within:
            allowed = {Path(n).name for n in
                       suite_files(args.testfixture, testdir, args.within)}
            names = [n for n in names if Path(n).name in allowed]
    else:
        names = args.files

    to_run: list[Path] = []
    excluded: list[dict] = []
    missing: list[str] = []
    seen = set()
    for n in names:
        p = resolve(testdir, n)
        if p is None:
            missing.append(n)
            continue
        if p.name in seen:
            continue
        seen.add(p.name)
        ex = excluded_by(p.name, exclusions)
        if ex is not None:
            excluded.append({"file": p.name, "category": ex.category,
                             "reason": ex.reason, "pattern": ex.pattern})
        else:
            to_run.append(p)
    if missing:
        print(f"sqlite-testsuite: no such test file(s): {' '.join(missing)}",
              file=sys.stderr)
        return 2

    as_user = args.as_user
    if as_user == "auto":
        as_user = "nobody" if os.geteuid() == 0 else None
    elif as_user == "none":
        as_user = None
    out = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "work").mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)
    stage = Stage(args.testfixture, srcdir, as_user)
    print(f"sqlite-testsuite: {len(to_run)} file(s) to run, "
          f"{len(excluded)} excluded; vfs={args.vfs} "
          f"selfcheck={'on' if args.selfcheck else 'off'} jobs={args.jobs} "
          f"user={as_user or os.environ.get('USER', 'self')}; "
          f"results in {out}", flush=True)
    started = time.monotonic()
    try:
        results = run_pool(args, stage, to_run, out, args.vfs,
                           args.selfcheck, started)
        failed = [r for r in results.values()
                  if r.status in ("failed", "crashed", "timeout")]
        if args.baseline and args.vfs == "verneuil" and failed:
            print(f"sqlite-testsuite: re-running {len(failed)} failed "
                  "file(s) with the plain unix VFS", flush=True)
            base = run_pool(args, stage, [p for p in to_run if p.name in
                                          {r.name for r in failed}],
                            out, "unix", False, started, ".unix",
                            verbose=False)
            for r in failed:
                classify_baseline(r, base[r.name])
    finally:
        stage.cleanup()
    elapsed = time.monotonic() - started

    ran = [r for r in results.values() if r.status != "not run"]
    bad = [r for r in ran if r.status in ("failed", "crashed", "timeout")]
    env_bad = [r for r in ran if r.status == "baseline"]
    tests = sum(r.tests for r in ran)
    errors = sum(r.errors for r in ran)
    env_errors = sum(r.errors for r in env_bad)
    sc_tot = dict.fromkeys(SELFCHECK_KEYS, 0)
    for r in ran:
        for k, v in r.selfcheck.items():
            sc_tot[k] += v
    not_run = [r.name for r in results.values() if r.status == "not run"]
    n_pass = len(ran) - len(bad) - len(env_bad)
    summary = {
        "vfs": args.vfs, "selfcheck": args.selfcheck, "user": as_user,
        "suite": args.suite or (str(args.list) if args.list else "files"),
        "mode": args.mode_suite, "seconds": round(elapsed, 1),
        "files_run": len(ran), "files_passed": n_pass,
        "files_failed": len(bad), "files_failed_baseline": len(env_bad),
        "files_excluded": len(excluded), "files_not_run": not_run,
        "tests_run": tests, "tests_passed": tests - errors,
        "tests_failed": errors, "tests_failed_baseline": env_errors,
        "selfcheck_totals": sc_tot,
        "failed_files": [asdict(r) for r in sorted(bad, key=lambda r: r.name)],
        "baseline_files": [asdict(r) for r in sorted(env_bad,
                                                     key=lambda r: r.name)],
        "excluded": excluded,
        "files": [asdict(r) for r in sorted(ran, key=lambda r: r.name)],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"sqlite-testsuite: {summary['suite']} vfs={args.vfs} "
        f"selfcheck={'on' if args.selfcheck else 'off'} in {elapsed:.0f}s",
        f"files: {len(ran)} run, {n_pass} passed, {len(bad)} failed, "
        f"{len(env_bad)} failed identically with the unix VFS, "
        f"{len(excluded)} excluded, {len(not_run)} not run (budget or "
        "interrupted)",
        f"tests: {tests} run, {tests - errors} passed, {errors} failed"
        + (f" ({env_errors} of them identically with the unix VFS)"
           if env_bad else ""),
    ]
    if args.selfcheck:
        lines.append("self-check: " + " ".join(
            f"{k}={v}" for k, v in sc_tot.items()))
    for r in sorted(bad + env_bad, key=lambda r: r.name):
        tag = "BASELINE" if r.status == "baseline" else "FAILED"
        lines.append(f"{tag} {r.name} ({r.status}; {r.errors}/{r.tests}"
                     + (f"; {'; '.join(r.notes)}" if r.notes else "") + ")"
                     + (f": {' '.join(r.failed_tests[:30])}"
                        if r.failed_tests else ""))
        lines.extend(f"    {line}" for line in r.selfcheck_problems[:3])
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    # The plain closing line (files, not test cases: a file is the unit).
    print(f"sqlite-testsuite: {n_pass + len(env_bad)} passed, "
          f"{len(bad)} failed")
    shutil.rmtree(out / "work", ignore_errors=True)
    if STOP.is_set():
        return 130
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
