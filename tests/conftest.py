"""Shared pytest fixtures: a real S3 endpoint (moto's server) and stores.

Fixtures (see tests/support/s3server.py for the server object's API):

- `aws_env` (session): fake AWS credentials/region in os.environ for the whole
  session (and every subprocess), no ~/.aws, no instance metadata.
- `s3_server` (session): an `S3Server` — `.endpoint`, `.stop()`, `.start()`,
  `.latency`, `.make_store(versioned=True, single_bucket=False,
  page_size=None, **client_options)`, `.new_bucket()`, `.url(...)`,
  `.admin` (a boto3 client straight to moto).  Skipped if moto is missing.
  A test that stops it must start it again (`finally: s3_server.start()`).
- `s3_store`: a fresh `Store` on new buckets of `s3_server` (manifest bucket
  versioned), closed after the test.
- `local_store`: a fresh directory `Store` under tmp_path.
- `any_store`: parametrized over both ("local", "s3"): write a test once,
  run it against both backends.

Tests using `s3_server` or `s3_store`, or parametrized with the value "s3"
(like `any_store`), get the `s3` marker automatically, so `-m "not s3"` skips
them; a test that starts its own `S3Server` should say `@pytest.mark.s3`.
"""
from __future__ import annotations

import os

import pytest

from support.s3server import S3Server, fake_aws_env, moto_available, patched_environ


@pytest.fixture(scope="session", autouse=True)
def mount_log_dir(tmp_path_factory):
    """Mounts that detach with no syslog log to a default file: under the
    session's temporary directory, not /var/log."""
    with patched_environ({"VERNEUIL_LOG_DIR": str(tmp_path_factory.mktemp("mount-logs"))}):
        yield


@pytest.fixture(scope="session")
def aws_env():
    with patched_environ(fake_aws_env()):
        yield


@pytest.fixture(scope="session")
def s3_server(aws_env, tmp_path_factory):
    if not moto_available():
        pytest.skip("moto[server] is not installed")
    server = S3Server(log_dir=str(tmp_path_factory.mktemp("moto")))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def s3_store(s3_server):
    if not s3_server.running:  # a previous test left an outage behind
        s3_server.start()
    store = s3_server.make_store()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def local_store(tmp_path):
    from verneuil_fuse.store import open_store

    store = open_store(f"file://{tmp_path}/store")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["local", "s3"])
def any_store(request):
    return request.getfixturevalue(f"{request.param}_store")


# The order the tests run in, cheapest tier first (scripts/test.sh): a test
# module's tier is the first prefix its name starts with; within a tier,
# pytest's own order. A module named after none runs with the last tier.
TIERS = ("test_structure", "test_format", "test_metrics", "test_store", "test_writer", "test_copier_unit",
         "test_copier", "test_history", "test_reader", "test_mount", "test_cli", "test_security", "test_fuzz", "test_end_to_end",
         "test_faults", "test_torture", "test_spark", "test_sqlite_testsuite", "test_bench")


def _tier(item) -> int:
    name = os.path.basename(str(item.fspath))
    return next((k for k, prefix in enumerate(TIERS) if name.startswith(prefix)), len(TIERS))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_tier)  # stable: pytest's order within a tier
    for item in items:
        names = getattr(item, "fixturenames", ())
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if "s3_server" in names or "s3_store" in names or any(p == "s3" for p in params):
            item.add_marker(pytest.mark.s3)


# CI explores the same hypothesis examples every run (a red CI then always
# means a change broke something); developers' runs keep exploring new ones.
if os.environ.get("CI"):
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("ci", derandomize=True, print_blob=True)
    _hsettings.load_profile("ci")
