"""Credentials that fail, hang or rotate never stall a mount (issue 36,
cases 1-3; docs/GUARANTEES.md, docs/READER.md "Errors and bounds").

Real mounts of moto's S3 with its signature checks on (every request's key
must exist in moto's IAM and its SigV4 signature match):

- a real credential_process (a script whose answers the test steers through
  a file) that hangs, then fails: reads that need new credentials fail with
  EREMOTEIO, one WARNING per episode names the cause; `stat`, `ls`, the
  stats file and reads of cached chunks answer within a second while the
  process hangs; once the process answers again, reads succeed and the
  chunk engine's path is still the one in use;
- a credentials file whose key is rotated (the old key deleted): re-read
  when the file changes, and when the store answers access denied although
  the file looks unchanged (same size, mtime and inode); reads go on without
  a remount (a read under way at the revocation may fail once).
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest

from support.credential_process import profile_config
from support.replicas import HOST, Mount, fuse_unavailable, publish, wait_for
from support.s3server import REGION, S3Server, patched_environ
from verneuil_fuse.reader.fetcher import FAILED_CHUNK_TTL
from verneuil_fuse.store import open_store
from verneuil_fuse.store.credentials import EXPIRY_MARGIN, REFRESH_TIMEOUT

pytestmark = [pytest.mark.fuse, pytest.mark.s3, pytest.mark.timeout(240)]
if fuse_unavailable():
    pytestmark.append(pytest.mark.skip(reason=fuse_unavailable()))

# Seconds a store takes to answer a `stat`, `ls`, the stats or a cached read
# at most while the credential_process hangs (docs: "a second").
QUICK_S = 1.0


def _data(tag: int, chunks: int = 5) -> bytes:
    body = bytearray(os.urandom(chunks * 65536))
    body[:16] = b"SQLite format 3\x00"
    body[100] = tag
    return bytes(body)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_errno(path: str) -> int:
    try:
        _read(path)
    except OSError as e:
        return e.errno
    return 0


def _read_soon(path: str) -> None:
    """Wait until ``path`` reads whole: a read under way when the key was
    revoked may have failed (its GETs were signed with the old key), and a
    chunk given up on fails at once for FAILED_CHUNK_TTL."""
    wait_for(lambda: _read_errno(path) == 0, FAILED_CHUNK_TTL + 10, "%s to read" % path)


class _NoEnvKeys(Mount):
    """A mount whose environment has no AWS keys: its credentials come from
    the files its options and ``extra`` name."""

    extra: dict = {}

    def env(self):
        env = {k: v for k, v in os.environ.items()
               if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")}
        env.update(self.extra)
        return env


@pytest.fixture(scope="module")
def signed(aws_env, tmp_path_factory):
    """moto with signature checks, a user allowed everything, its buckets."""
    root = tmp_path_factory.mktemp("signed")
    with S3Server(auth=True, free_actions=3, log_dir=str(root)) as server:
        keys = server.user_credentials("admin")
        import boto3
        session = boto3.session.Session(aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"], region_name=REGION)
        server.iam = session.client("iam", endpoint_url=server.moto_endpoint)
        s3 = session.client("s3", endpoint_url=server.moto_endpoint)
        for bucket in ("creds-chunks", "creds-manifests"):
            s3.create_bucket(Bucket=bucket)
        server.keys = keys
        server.store_url = server.url("creds-chunks", "creds-manifests")
        yield server


def _publish(server, datas: dict[str, bytes]) -> None:
    with patched_environ(server.keys):
        store = open_store(server.store_url)
        try:
            for name, data in datas.items():
                publish(store, data, "/data/" + name, hostname=HOST)
        finally:
            store.close()


def _new_key(server, user: str) -> dict:
    key = server.iam.create_access_key(UserName=user)["AccessKey"]
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


def test_a_hanging_then_failing_credential_process(signed, tmp_path):
    datas = {name: _data(k) for k, name in enumerate(("warm.db", "fail.db", "hang.db"))}
    _publish(signed, datas)
    keys = {"key": signed.keys["AWS_ACCESS_KEY_ID"], "secret": signed.keys["AWS_SECRET_ACCESS_KEY"]}
    ctl = tmp_path / "ctl.json"
    short = EXPIRY_MARGIN + 6  # usable for 6 s from each run of the process

    def steer(mode: str, ttl: float = short) -> None:
        ctl.write_text(json.dumps(dict(keys, mode=mode, ttl=ttl)))

    steer("ok")
    config = tmp_path / "config"
    config.write_text(profile_config("p", str(ctl)))
    log = tmp_path / "mount.log"

    class ProcessMount(_NoEnvKeys):
        extra = {"AWS_CONFIG_FILE": str(config)}

    options = ("profile=p,cache_dir=%s,log_file=%s,log_level=info,refresh=3600,deadline=4,timeout=2"
               % (tmp_path / "cache", log))
    d = "/%s/data" % HOST
    with ProcessMount(signed.store_url, str(tmp_path / "mnt"), options) as m:
        assert _read(m.path(d, "warm.db")) == datas["warm.db"]

        def credentials() -> dict:
            return m.stats()["fetch"]["store"]["credentials"]

        # Case 1: the process hangs once the keys run out. While a read
        # that needs the store waits for it, nothing the mount can answer
        # without the store waits.
        steer("hang")
        wait_for(lambda: credentials()["expires_in"] < EXPIRY_MARGIN - 1, 30, "the keys to run out")
        outcome: list = []
        reader = threading.Thread(target=lambda: outcome.append(_read_errno(m.path(d, "hang.db"))))
        reader.start()
        wait_for(lambda: credentials()["refreshing"], 10, "a refresh under way")
        for what, call in (("stat", lambda: os.stat(m.path(d, "warm.db"))),
                           ("ls", lambda: os.listdir(m.path(d))),
                           ("stats", lambda: m.stats()),
                           ("cached read", lambda: _read(m.path(d, "warm.db")))):
            start = time.monotonic()
            call()
            took = time.monotonic() - start
            assert took < QUICK_S, (what, took)
        reader.join(2 * 4 + 5)  # within the read's deadline (the kernel asks twice)
        assert outcome == [errno.EREMOTEIO]
        steer("ok")
        wait_for(lambda: credentials()["ok"], REFRESH_TIMEOUT + 40, "credentials after the hang")
        assert "ran for more than" in log.read_text()
        # (a chunk given up on fails at once for FAILED_CHUNK_TTL)
        wait_for(lambda: _read_errno(m.path(d, "hang.db")) == 0, FAILED_CHUNK_TTL + 5, "hang.db to read")
        assert _read(m.path(d, "hang.db")) == datas["hang.db"]
        assert m.stats()["fetch"]["engine_path"]  # case 2: the chunk engine's path serves again

        # Case 2: the process fails once the keys run out: reads that need
        # the store fail with EREMOTEIO, cached ones still work; one warning
        # per episode, with the cause.
        steer("fail")
        wait_for(lambda: credentials()["expires_in"] < EXPIRY_MARGIN - 1, 30, "the keys to run out")
        assert _read_errno(m.path(d, "fail.db")) == errno.EREMOTEIO
        assert not credentials()["ok"] and credentials()["failures"] >= 2, credentials()
        assert _read(m.path(d, "warm.db")) == datas["warm.db"]
        text = log.read_text()
        assert text.count("cannot refresh the AWS credentials") == 2, text  # the hang's episode, this one
        assert "the vault is sealed" in text, text
        steer("ok", ttl=3600)
        wait_for(lambda: credentials()["ok"], 40, "credentials again")
        wait_for(lambda: _read_errno(m.path(d, "fail.db")) == 0, FAILED_CHUNK_TTL + 5, "fail.db to read")
        assert _read(m.path(d, "fail.db")) == datas["fail.db"]
        fetch = m.stats()["fetch"]
        assert fetch["engine_path"], fetch


def test_a_rotated_credentials_file_is_read_again(signed, tmp_path):
    datas = {name: _data(10 + k) for k, name in enumerate(("one.db", "two.db", "three.db"))}
    _publish(signed, datas)
    signed.iam.create_user(UserName="rotator")
    signed.iam.put_user_policy(UserName="rotator", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    creds = tmp_path / "credentials"

    def write(key: dict) -> None:
        creds.write_text("[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n"
                         % (key["key"], key["secret"]))

    first = _new_key(signed, "rotator")
    write(first)
    log = tmp_path / "mount.log"
    options = ("credentials_file=%s,cache_dir=%s,log_file=%s,log_level=info,refresh=3600,deadline=8,timeout=2"
               % (creds, tmp_path / "cache", log))
    d = "/%s/data" % HOST
    with _NoEnvKeys(signed.store_url, str(tmp_path / "mnt"), options) as m:
        assert _read(m.path(d, "one.db")) == datas["one.db"]
        # The key is rotated in the file, the old one revoked.
        second = _new_key(signed, "rotator")
        write(second)
        signed.iam.delete_access_key(UserName="rotator", AccessKeyId=first["key"])
        _read_soon(m.path(d, "two.db"))
        assert _read(m.path(d, "two.db")) == datas["two.db"]
        # Again, the file keeping its size, mtime and inode: only the
        # store's access-denied answer tells the mount.
        before = os.stat(creds)
        third = _new_key(signed, "rotator")
        assert len(third["key"]) == len(second["key"]) and len(third["secret"]) == len(second["secret"])
        with open(creds, "r+") as f:
            f.write(creds.read_text().replace(second["key"], third["key"]).replace(second["secret"], third["secret"]))
        os.utime(creds, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(creds)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
        signed.iam.delete_access_key(UserName="rotator", AccessKeyId=second["key"])
        _read_soon(m.path(d, "three.db"))
        assert _read(m.path(d, "three.db")) == datas["three.db"]
        assert m.stats()["fetch"]["store"]["credentials"]["refreshes"] >= 3
