#!/usr/bin/env python3
"""The mount under a storm of 503 SlowDown answers (issue 36, case 4).

    .venv/bin/python scripts/bench_throttle.py [--before 10] [--storm 60]
        [--after 20] [--share 0.8] [--readers 4] [--size-mb 8] [--json out.json]

One real mount of moto's S3 through the test fault proxy (tests/support/
throttlerun.py): readers scan a replica over and over with no cache, the
store first answers everything, then refuses ``--share`` of the chunk GETs
with SlowDown for ``--storm`` seconds, then answers everything again. Prints
the chunk GETs per second (and how many were refused), the mean rates before,
in and after the storm, the peak in the storm, the seconds until the rate is
back to half of the rate before, what the scans got (right bytes, EREMOTEIO,
wrong), and the mount's throttle state. Needs root (a mount) and moto[server];
docs/BENCHMARKS.md has the figures with their date and build.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

from support.s3server import S3Server, fake_aws_env, patched_environ  # noqa: E402
from support.throttlerun import run_storm  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=float, default=10.0, help="seconds answered in full first (10)")
    p.add_argument("--storm", type=float, default=60.0, help="seconds of the storm (60)")
    p.add_argument("--after", type=float, default=20.0, help="seconds answered in full after (20)")
    p.add_argument("--share", type=float, default=0.8, help="share of chunk GETs refused in the storm (0.8)")
    p.add_argument("--readers", type=int, default=4, help="threads scanning the replica (4)")
    p.add_argument("--size-mb", type=int, default=8, help="size of the replica (8 MiB)")
    p.add_argument("--json", help="write the results there too")
    return p.parse_args(argv)


def build() -> str:
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-throttle-") as root, patched_environ(fake_aws_env()), \
            S3Server(log_dir=root) as server:
        r = run_storm(server, root, before=args.before, storm=args.storm, after=args.after,
                      share=args.share, readers=args.readers, size_mb=args.size_mb)
    storm_end = args.before + args.storm
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "build": build(),
        "before_s": args.before, "storm_s": args.storm, "after_s": args.after, "share": args.share,
        "gets_per_s": r.gets, "refused_per_s": r.refused,
        "rate_before": round(r.unthrottled, 1), "rate_in_storm": round(r.in_storm, 1),
        "peak_in_storm": r.peak_in_storm, "rate_after": round(r.rate(storm_end + 2, storm_end + args.after), 1),
        "gets_in_storm": sum(r.gets[int(args.before):int(storm_end)]),
        "refused_in_storm": sum(r.refused[int(args.before):int(storm_end)]),
        "recovery_s": r.recovery(0.5), "scans_right": r.right, "scans_eremoteio": r.remote_errors,
        "scans_wrong": len(r.wrong), "throttle_in_storm": r.throttle_in_storm, "throttle_after": r.throttle_after,
    }
    print("chunk GETs per second (refused):")
    print(" ".join("%d(%d)" % pair for pair in zip(r.gets, r.refused)))
    for key in ("rate_before", "rate_in_storm", "peak_in_storm", "rate_after", "gets_in_storm",
                "refused_in_storm", "recovery_s", "scans_right", "scans_eremoteio", "scans_wrong",
                "throttle_in_storm", "throttle_after"):
        print("%-18s %s" % (key, out[key]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if not r.wrong else 1


if __name__ == "__main__":
    sys.exit(main())
