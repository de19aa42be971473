"""A real S3 endpoint for tests: moto's server in a subprocess, behind a small
TCP proxy that tests can switch off and on (an outage) or slow down.

This module owns test-side S3 plumbing reused by every test tier (store,
copier, reader, benchmarks):

    server = S3Server()          # starts `moto_server` on 127.0.0.1 + the proxy
    server.endpoint              # http://127.0.0.1:PORT  (the proxy; stable)
    server.make_store()          # fresh chunk + versioned manifest buckets -> Store
    server.stop(); server.start()  # outage: connections refused, then back;
                                   # moto keeps its buckets (it keeps running)
    server.latency = 0.02        # add 20 ms before each request
    server.close()

`S3Server(auth=True)` starts moto with IAM auth enforced
(`INITIAL_NO_AUTH_ACTION_COUNT=0`), so any access key is refused: the
bad-credentials case.

Environment: `fake_aws_env()` returns the variables that make boto3 use fake
credentials and never consult ~/.aws or an instance-metadata service; the
pytest fixture (conftest.py) puts them in os.environ for the session, so
subprocesses (copier, mounts, Spark) inherit them.

Only loopback addresses are bound.  The moto process gets SIGTERM if the test
process dies (PR_SET_PDEATHSIG), so no server outlives a crashed run.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"

# Seconds to wait for moto's server to accept connections (it imports moto,
# about 0.5 s here; generous for a loaded CI machine).
STARTUP_TIMEOUT = 30.0

# Seconds between readiness probes while it starts.
STARTUP_POLL = 0.05

# Seconds to wait for moto to exit on SIGTERM before SIGKILL.
SHUTDOWN_TIMEOUT = 5.0

# Bytes per recv() in the proxy: one 64 KiB chunk plus headers in a few calls.
PROXY_BUFFER = 256 * 1024

# Region used by test stores (us-east-1: CreateBucket needs no LocationConstraint).
REGION = "us-east-1"

# Fake credentials for moto (it accepts any when auth is not enforced).
FAKE_ACCESS_KEY = "testing"
FAKE_SECRET_KEY = "testing"

_bucket_counter = itertools.count()


def fake_aws_env() -> dict[str, str]:
    """Environment variables for boto3 in tests: fake credentials, a region,
    and no lookups of real configuration or instance metadata."""
    return {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def patched_environ(values: dict[str, str]):
    """Set environment variables, restoring the old values afterwards."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_port() -> int:
    """A TCP port on HOST that was free a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# Run in the child: ask for SIGTERM when the parent dies, then become moto.
# (Done by exec'ing through Python rather than with preexec_fn, which is not
# safe once the test process has threads.)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "except Exception:\n"
    "    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


def _moto_command(port: int) -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if not os.path.exists(script):
        script = shutil.which("moto_server") or ""
    if script:
        command = [script, "-H", HOST, "-p", str(port)]
    else:
        command = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    return [sys.executable, "-c", _DIE_WITH_PARENT, *command]


def moto_available() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


# Request methods the proxy recognises at the start of a request.
_METHODS = (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE")


def classify(first: bytes) -> str | None:
    """The counter name of a request that starts with ``first``: its method,
    except that a GET of a bucket (a listing, path-style ``/bucket``) is
    "LIST"; None when ``first`` does not start a request (e.g. a body sent
    after ``100 Continue``)."""
    parts = first.split(b"\r\n", 1)[0].split(b" ")
    if len(parts) != 3 or parts[0] not in _METHODS or not parts[2].startswith(b"HTTP/"):
        return None
    if parts[0] != b"GET":
        return parts[0].decode()
    path = parts[1].split(b"?", 1)[0]
    return "GET" if len([seg for seg in path.split(b"/") if seg]) >= 2 else "LIST"


class Proxy:
    """Forwards TCP connections from HOST:port to HOST:target_port, and
    counts what goes through.

    `stop()` closes the listener and every open connection (clients then get
    "connection refused"); `start()` listens again on the same port.
    `latency` seconds are slept before forwarding each new request (the first
    client bytes after the server last spoke), about one round trip.
    Requests are counted by `classify` and bytes by direction: `snapshot()`,
    and `delta(before, after)` between two snapshots.
    """

    def __init__(self, target_port: int, latency: float = 0.0) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.latency = latency
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()
        self._counts: dict[str, int] = {}
        self._bytes = {"down": 0, "up": 0}

    @property
    def running(self) -> bool:
        return self._listener is not None

    @property
    def endpoint(self) -> str:
        return "http://%s:%d" % (HOST, self.port)

    # -- counters ---------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["bytes_down"] = self._bytes["down"]
            out["bytes_up"] = self._bytes["up"]
            return out

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        """Counts between two snapshots: requests (all methods), GETs
        (object GETs), LISTs, HEADs, PUTs, bytes down/up."""
        d = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
        requests = sum(v for k, v in d.items() if not k.startswith("bytes_"))
        return {"requests": requests, "gets": d.get("GET", 0), "lists": d.get("LIST", 0),
                "heads": d.get("HEAD", 0), "puts": d.get("PUT", 0) + d.get("POST", 0),
                "bytes_down": d.get("bytes_down", 0), "bytes_up": d.get("bytes_up", 0)}

    # -- plumbing ---------------------------------------------------------
    def start(self) -> None:
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, self.port))
        listener.listen(256)
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, args=(listener,), name="s3-proxy-accept", daemon=True
        )
        self._accept_thread.start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                # Without TCP_NODELAY every request stalls ~40 ms on delayed ACKs.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self._sockets.update((client, upstream))
            conn = _Connection(client, upstream)
            threading.Thread(target=self._pump, args=(conn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(conn, False), daemon=True).start()

    def _pump(self, conn: "_Connection", request: bool) -> None:
        src, dst = (conn.client, conn.upstream) if request else (conn.upstream, conn.client)
        direction = "up" if request else "down"
        try:
            while True:
                data = src.recv(PROXY_BUFFER)
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    break
                if request:
                    if conn.server_spoke:
                        kind = classify(data[:4096])
                        if kind is not None:
                            with self._lock:
                                self._counts[kind] = self._counts.get(kind, 0) + 1
                        if self.latency > 0:
                            time.sleep(self.latency)
                    conn.server_spoke = False
                else:
                    conn.server_spoke = True
                with self._lock:
                    self._bytes[direction] += len(data)
                dst.sendall(data)
        except OSError:
            for sock in (src, dst):  # wakes the other direction
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if conn.finish_one():
            with self._lock:
                self._sockets.discard(conn.client)
                self._sockets.discard(conn.upstream)
            conn.client.close()
            conn.upstream.close()


class _Connection:
    """One proxied connection; closed when both directions are done."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.server_spoke = True
        self._pending = 2
        self._lock = threading.Lock()

    def finish_one(self) -> bool:
        """Record one direction as done; True for the last one."""
        with self._lock:
            self._pending -= 1
            return self._pending == 0


class S3Server:
    """moto's S3 server in a subprocess, reachable through an outage proxy."""

    def __init__(self, *, auth: bool = False, log_dir: str | None = None, free_actions: int = 0) -> None:
        """`auth`: moto checks every request's credentials and signature,
        except the first `free_actions` (to create IAM users and keys)."""
        self.auth = auth
        self._moto_port = free_port()
        self._log = tempfile.NamedTemporaryFile(
            prefix="moto-", suffix=".log", dir=log_dir, delete=False
        )
        env = dict(os.environ)
        env.update(fake_aws_env())
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(free_actions)
        else:
            env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        self._process = subprocess.Popen(
            _moto_command(self._moto_port),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self._proxy = Proxy(self._moto_port)
        self._proxy.start()
        self._admin: Any = None
        logger.info("moto S3 at %s (proxy of %s)", self.endpoint, self.moto_endpoint)

    # -- endpoints -------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The URL clients should use (through the proxy; survives stop/start)."""
        return f"http://{HOST}:{self._proxy.port}"

    @property
    def moto_endpoint(self) -> str:
        """moto's own URL, bypassing the proxy (always up while the server lives)."""
        return f"http://{HOST}:{self._moto_port}"

    @property
    def log_path(self) -> str:
        return self._log.name

    # -- outages and latency ----------------------------------------------

    def stop(self) -> None:
        """Simulate an outage: refuse new connections and drop open ones."""
        self._proxy.stop()

    def start(self) -> None:
        """End the outage (same endpoint, same buckets)."""
        self._proxy.start()

    @property
    def running(self) -> bool:
        return self._proxy.running

    @property
    def latency(self) -> float:
        return self._proxy.latency

    @latency.setter
    def latency(self, seconds: float) -> None:
        self._proxy.latency = seconds

    # -- buckets and stores ---------------------------------------------

    def counts(self) -> dict:
        """The proxy's request and byte counters (`Proxy.snapshot`)."""
        return self._proxy.snapshot()

    @property
    def admin(self) -> Any:
        """A boto3 client straight to moto, for setting up and inspecting."""
        if self._admin is None:
            import boto3

            self._admin = boto3.session.Session(
                aws_access_key_id=FAKE_ACCESS_KEY,
                aws_secret_access_key=FAKE_SECRET_KEY,
                region_name=REGION,
            ).client("s3", endpoint_url=self.moto_endpoint)
        return self._admin

    def new_bucket(self, stem: str = "bucket", *, versioned: bool = False) -> str:
        """Create a uniquely named bucket; its name."""
        name = f"{stem}-{next(_bucket_counter)}-{secrets.token_hex(4)}"
        self.admin.create_bucket(Bucket=name)
        if versioned:
            self.admin.put_bucket_versioning(
                Bucket=name, VersioningConfiguration={"Status": "Enabled"}
            )
        return name

    def url(self, chunk_bucket: str, manifest_bucket: str | None = None, **params: str) -> str:
        """An `s3://` store URL for buckets on this server (through the proxy)."""
        query = {"endpoint": self.endpoint, "region": REGION, "addressing": "path", **params}
        if manifest_bucket is not None:
            query["manifest_bucket"] = manifest_bucket
        return f"s3://{chunk_bucket}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def user_credentials(self, name: str) -> dict:
        """A new IAM user allowed everything (for a server started with
        ``auth=True``): its keys as the AWS_* environment variables."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.moto_endpoint, region_name=REGION)
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def make_store(
        self,
        versioned: bool = True,
        *,
        single_bucket: bool = False,
        page_size: int | None = None,
        layout: str = "chunks",
        **client_options: Any,
    ):
        """Fresh buckets and a `Store` on them.

        Default: a chunk bucket and a manifest bucket (versioned if
        `versioned`), Verneuil's layout.  `single_bucket`: one bucket with
        `chunks/` and `manifests/` prefixes.  `page_size` shrinks listing pages
        (to test pagination); `client_options` go to `s3.make_client` (e.g.
        `max_attempts=1`).  `layout="packed"`: copiers write packs
        (docs/FORMAT.md, "Packed layout").  `store.url` reopens the same
        store elsewhere.
        """
        from verneuil_fuse.store import open_store

        params = {} if layout == "chunks" else {"layout": layout}
        if single_bucket:
            url = self.url(self.new_bucket("store", versioned=versioned), **params)
        else:
            chunks = self.new_bucket("chunks")
            manifests = self.new_bucket("manifests", versioned=versioned)
            url = self.url(chunks, manifests, **params)
        store = open_store(url, **client_options)
        if page_size is not None:
            store.chunks.page_size = page_size
            store.manifests.page_size = page_size
        return store

    def reset(self) -> None:
        """Delete every bucket (moto's reset API)."""
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(self.moto_endpoint + "/moto-api/reset", method="POST"),
            timeout=10,
        ).read()

    # -- lifecycle ----------------------------------------------------------

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self._process.returncode}: {self._log_tail()}"
                )
            try:
                socket.create_connection((HOST, self._moto_port), timeout=1).close()
                return
            except OSError:
                time.sleep(STARTUP_POLL)
        raise RuntimeError(f"moto_server did not start in {STARTUP_TIMEOUT} s: {self._log_tail()}")

    def _log_tail(self, size: int = 2000) -> str:
        try:
            with open(self._log.name, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - size))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(SHUTDOWN_TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def close(self) -> None:
        """Stop the proxy and the moto process; remove the log."""
        if getattr(self, "_proxy", None) is not None:
            self._proxy.stop()
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        self._kill()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
