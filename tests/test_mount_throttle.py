"""A store that throttles slows the mount down, and it speeds up again
(issue 36, case 4; docs/GUARANTEES.md, docs/READER.md "Errors and bounds").

One real mount of moto's S3 through the fault proxy, four readers scanning
a replica over and over with no cache: 3 s answered in full, 6 s with 80 %
of the chunk GETs answered 503 SlowDown, 8 s answered in full again. The
GETs the mount sends in the storm (its first second left out) are at most
as many per second as before it, the rate is back to half of it within
10 s after, every scan reads right bytes or fails with EREMOTEIO, never
anything else, and the stats show the limit that came down. The 60 s storm
with its figures is scripts/bench_throttle.py (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import pytest

from support.replicas import fuse_unavailable
from support.throttlerun import run_storm

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(180)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

# The storm ends; the GET rate must be back to this share of the rate before
# it within RECOVERY_S seconds.
RECOVERY_SHARE = 0.5
RECOVERY_S = 10.0


def test_a_slowdown_storm_lowers_the_get_rate_and_it_recovers(s3_server, tmp_path):
    if not s3_server.running:
        s3_server.start()
    r = run_storm(s3_server, str(tmp_path))
    report = "GETs per second %s (refused %s); right %d, EREMOTEIO %d; throttle %s then %s" % (
        r.gets, r.refused, r.right, r.remote_errors, r.throttle_in_storm, r.throttle_after)
    assert not r.wrong, (r.wrong[:5], report)
    assert r.right > 0, report
    assert r.unthrottled > 20, report  # the readers kept the store busy before the storm
    assert r.in_storm <= r.unthrottled, report
    recovery = r.recovery(RECOVERY_SHARE)
    assert recovery is not None and recovery <= RECOVERY_S, report
    assert r.throttle_in_storm["throttles"] > 0 and r.throttle_in_storm["limit"] < r.throttle_in_storm["ceiling"], report
    assert not r.throttle_after["throttled"], report
    print(report)
