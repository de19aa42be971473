"""The peers: s3fs-fuse and rclone mounting one object (the raw database
file) from the same moto server, through the same counting proxy.

Each mount is a foreground process started by PID, ready once the mount
point is in /proc/self/mountinfo and the file is visible; `stop()` unmounts
with `fusermount3 -u -z` and ends that PID (SIGTERM, then SIGKILL), every
wait bounded.  Both keep their defaults except where noted (read-only,
path-style addressing, fake credentials, no polling, attributes cached for
the length of the run, rclone's cache directory under the run's temp dir).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from support.replicas import FuseProcess, wait_for  # noqa: E402

from . import apt_install  # noqa: E402
from support.s3server import FAKE_ACCESS_KEY, FAKE_SECRET_KEY, REGION  # noqa: E402

APT_TOOLS = {"s3fs": "s3fs", "rclone": "rclone"}
MOUNT_TIMEOUT = 30.0


def ensure_tools(log=print) -> dict:
    """Install the Debian packages s3fs and rclone if missing (apt-get, as
    root; bounded); the versions found."""
    apt_install([pkg for exe, pkg in APT_TOOLS.items() if shutil.which(exe) is None], log)
    versions = {}
    for exe in APT_TOOLS:
        if shutil.which(exe) is None:
            versions[exe] = None
            continue
        flag = "--version" if exe == "s3fs" else "version"
        out = subprocess.run([exe, flag], capture_output=True, text=True, timeout=30).stdout
        versions[exe] = out.strip().splitlines()[0] if out.strip() else "?"
    return versions


class _FuseProcess(FuseProcess):
    """A peer's mount: ready once mounted *and* the file is visible."""

    def start(self, filename: str) -> "_FuseProcess":  # type: ignore[override]
        super().start(MOUNT_TIMEOUT)
        try:
            wait_for(lambda: os.path.exists(self.path(filename)), MOUNT_TIMEOUT,
                     "%s to show %s" % (self.name, filename), interval=0.1)
        except BaseException:
            self.stop()
            raise
        return self


class S3fsMount(_FuseProcess):
    """`s3fs BUCKET MNT -f`: no disk cache (s3fs's default), range GETs."""

    name = "s3fs"

    def __init__(self, endpoint: str, bucket: str, mountpoint: str, work: str) -> None:
        super().__init__(mountpoint, os.path.join(work, "s3fs-%s.log" % os.path.basename(mountpoint)))
        self.endpoint = endpoint
        self.bucket = bucket
        self.passwd = os.path.join(work, "s3fs.passwd")
        with open(os.open(self.passwd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write("%s:%s\n" % (FAKE_ACCESS_KEY, FAKE_SECRET_KEY))

    def command(self) -> list[str]:
        opts = ["url=%s" % self.endpoint, "use_path_request_style", "endpoint=%s" % REGION,
                "passwd_file=%s" % self.passwd, "ro", "stat_cache_expire=3600",
                "dbglevel=warn"]
        return ["s3fs", self.bucket, self.mountpoint, "-f", "-o", ",".join(opts)]


class RcloneMount(_FuseProcess):
    """`rclone mount :s3:BUCKET MNT` with --vfs-cache-mode off or full."""

    def __init__(self, endpoint: str, bucket: str, mountpoint: str, work: str,
                 cache_mode: str, cache_dir: str) -> None:
        super().__init__(mountpoint, os.path.join(work, "rclone-%s.log" % os.path.basename(mountpoint)))
        self.name = "rclone (vfs cache %s)" % cache_mode
        self.endpoint = endpoint
        self.bucket = bucket
        self.cache_mode = cache_mode
        self.cache_dir = cache_dir

    def env(self) -> dict:
        env = dict(os.environ)
        env["RCLONE_CONFIG"] = "/dev/null"  # no config file: everything is on the command line
        # The endpoint is plain HTTP on 127.0.0.1; rclone refuses to start when
        # a CA bundle is configured for its HTTP transport.
        env.pop("AWS_CA_BUNDLE", None)
        return env

    def command(self) -> list[str]:
        return ["rclone", "mount", ":s3:%s" % self.bucket, self.mountpoint,
                "--s3-provider", "Other", "--s3-endpoint", self.endpoint,
                "--s3-access-key-id", FAKE_ACCESS_KEY, "--s3-secret-access-key", FAKE_SECRET_KEY,
                "--s3-region", REGION, "--s3-force-path-style=true",
                "--read-only", "--vfs-cache-mode", self.cache_mode,
                "--cache-dir", self.cache_dir,
                "--dir-cache-time", "1h", "--attr-timeout", "1h", "--poll-interval", "0",
                "--log-level", "NOTICE"]

