"""The credential keeper with a real credential_process (store/credentials.py;
issue 36, cases 1-3; the mount's side is tests/test_mount_credentials.py).

- credentials still valid keep serving at once while a refresh ahead of
  their expiry hangs; the hanging process is killed at the time limit and
  the failure said once;
- a failing process makes `frozen` raise CredentialsUnavailable at once
  once the credentials are no longer usable, and the keeper tries again by
  itself;
- access denied re-reads the chain at most once per interval for one key.
"""
from __future__ import annotations

import json
import logging
import time

import botocore.session
import pytest

from support.credential_process import profile_config
from verneuil_fuse.store import credentials as kc



@pytest.fixture
def process(tmp_path, monkeypatch):
    ctl = tmp_path / "ctl.json"
    config = tmp_path / "config"
    config.write_text(profile_config("p", str(ctl)))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")

    def steer(mode: str, key: str = "AKIA0000000000000001", ttl: float = 600) -> None:
        ctl.write_text(json.dumps({"mode": mode, "key": key, "secret": "s", "ttl": ttl}))

    def keeper() -> kc.CredentialKeeper:
        session = botocore.session.Session(profile="p")
        k = kc.CredentialKeeper(session, "test store")
        k.adopt(session.get_credentials())
        return k

    steer("ok")
    return steer, keeper, ctl


def test_valid_credentials_serve_while_a_refresh_hangs(process, monkeypatch, caplog):
    steer, keeper, ctl = process
    monkeypatch.setattr(kc, "REFRESH_TIMEOUT", 2.0)
    k = keeper()  # 10 minutes left: inside REFRESH_AHEAD, far from EXPIRY_MARGIN
    steer("hang")
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        assert k.frozen(0).access_key == "AKIA0000000000000001"  # a refresh ahead starts, and hangs
        for _ in range(50):
            assert k.frozen(0).access_key == "AKIA0000000000000001"
        assert time.monotonic() - start < 0.5
        assert k.describe()["refreshing"]
        deadline = time.monotonic() + 10
        while k.describe()["refreshing"] and time.monotonic() < deadline:
            time.sleep(0.05)
    state = k.describe()
    assert not state["refreshing"] and state["failures"] == 1 and "ran for more than" in state["last_error"], state
    assert k.frozen(0).access_key == "AKIA0000000000000001"  # still valid: still served
    said = [r.getMessage() for r in caplog.records if "cannot refresh" in r.getMessage()]
    assert len(said) == 1 and "current ones serve" in said[0], said


def test_unusable_credentials_fail_at_once_and_are_tried_again(process, monkeypatch):
    steer, keeper, ctl = process
    monkeypatch.setattr(kc, "RETRY_FIRST", 0.2)
    steer("ok", ttl=kc.EXPIRY_MARGIN + 1)
    k = keeper()
    steer("fail")
    time.sleep(1.2)  # past the margin: unusable
    with pytest.raises(kc.CredentialsUnavailable):
        k.frozen(0)
    deadline = time.monotonic() + 10
    while k.describe()["failures"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    with pytest.raises(kc.CredentialsUnavailable, match="the vault is sealed"):
        k.frozen(5.0)  # no refresh under way: nothing to wait for
    assert time.monotonic() - start < 0.5
    steer("ok", key="AKIA0000000000000002")
    deadline = time.monotonic() + 10  # tried again by itself, no request needed
    while not k.describe()["ok"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert k.frozen(0).access_key == "AKIA0000000000000002"


def test_access_denied_rereads_once_per_interval_for_one_key(process):
    steer, keeper, ctl = process
    k = keeper()
    runs = ctl.parent / (ctl.name + ".runs")
    before = len(runs.read_text().split())
    for _ in range(20):
        k.denied()
        k.frozen(0)
        time.sleep(0.01)
    deadline = time.monotonic() + 10
    while k.describe()["refreshing"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(runs.read_text().split()) - before == 1  # twenty denials of one key: one re-read
    steer("ok", key="AKIA0000000000000003")
    k.denied()
    k.frozen(0)  # ... the same key still: within the interval, no re-read
    time.sleep(0.3)
    assert len(runs.read_text().split()) - before == 1
