"""A benchmark store that is not the bottleneck: Debian's nginx in front of
moto's S3 server.

GETs, HEADs and PUTs of objects in the *static* buckets (the chunk bucket,
the raw database file the peers mount) are served by nginx from a directory
holding exactly the bytes S3 holds, one file per key (the layout of a
`file://` store; PUTs through nginx's WebDAV module); everything else
(listings, manifests, bucket requests, multipart uploads) goes to moto.  Each request waits `latency_ms` inside nginx first (the echo module's
`echo_sleep`, a timer in nginx's event loop: no process or thread per
request), since this kernel has no `sch_netem`.

nginx serves a 64 KiB object for about 0.04 ms of CPU (one worker), against
about 3 ms for moto, so the client's own cost per request shows.  Every
request is counted from nginx's access log, in the shape of
`proxy.CountingProxy.snapshot`.

`ensure_nginx` installs Debian's `nginx-light` and `libnginx-mod-http-echo`
if missing (apt-get, as root, bounded; Debian's policy-rc.d keeps the system
service from starting in containers).  `NginxRig.close` ends the nginx it
started, by PID.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from . import apt_install

APT_PACKAGES = ("nginx-light", "libnginx-mod-http-echo")
ECHO_MODULE = "/usr/lib/nginx/modules/ngx_http_echo_module.so"
START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
# Enough connections for every client's pool (s3fs, rclone and the mount
# each keep up to 64-128 open) with room to spare.
WORKER_CONNECTIONS = 4096

# `user root`: the benchmark runs as root and its work directory is private
# (0700), so the worker must read the files as root.
_CONF = """\
load_module {echo};
user root root;
worker_processes 1;
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections {conns}; }}
http {{
  log_format counts '$request_method "$is_args" $body_bytes_sent $request_length';
  access_log {work}/access.log counts;
  client_body_temp_path {work}/body;
  proxy_temp_path {work}/proxy;
  client_max_body_size 0;
  keepalive_requests 1000000;
  keepalive_timeout 300s;
  upstream moto {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  # Object requests nginx answers from files: GET, HEAD, and PUT (WebDAV)
  # without a query string; the rest (listings, versions, multipart) go to moto.
  map "$request_method:$is_args" $from_files {{ "GET:" 1; "HEAD:" 1; "PUT:" 1; default 0; }}
  server {{
    listen 127.0.0.1:{port};
{static}
    location / {{ {sleep} echo_exec @upstream; }}
    location @upstream {{
      proxy_pass http://moto;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
"""
# A bucket's own URL (listings, bucket checks) goes to moto; its objects'
# GETs, HEADs and PUTs are files (`$from_files`).
_STATIC = """\
    location = /{bucket}/ {{ {sleep} echo_exec @upstream; }}
    location /{bucket}/ {{
      if ($from_files = 0) {{ {sleep} echo_exec @upstream; }}
      {sleep} echo_exec @files;
    }}
"""
_FILES = """\
    location @files {{
      root {root};
      dav_methods PUT;
      create_full_put_path on;
    }}
"""


def ensure_nginx(log=print) -> str | None:
    """nginx's version, after installing the Debian packages if missing."""
    if shutil.which("nginx") is None or not os.path.exists(ECHO_MODULE):
        apt_install(APT_PACKAGES, log)
    if shutil.which("nginx") is None or not os.path.exists(ECHO_MODULE):
        return None
    out = subprocess.run(["nginx", "-v"], capture_output=True, text=True, timeout=30)
    return (out.stderr or out.stdout).strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NginxRig:
    """nginx on 127.0.0.1, static buckets from `root` (`root/<bucket>/<key>`),
    the rest proxied to moto on `upstream_port`."""

    def __init__(self, work: str, root: str, static_buckets: list[str], upstream_port: int,
                 latency_ms: float) -> None:
        self.work = os.path.abspath(work)
        os.makedirs(self.work, exist_ok=True)
        self.port = _free_port()
        self.endpoint = "http://127.0.0.1:%d" % self.port
        sleep = "echo_sleep %.3f;" % (latency_ms / 1000.0) if latency_ms > 0 else ""
        static = "".join(_STATIC.format(bucket=b, sleep=sleep) for b in static_buckets)
        static += _FILES.format(root=os.path.abspath(root))
        conf = _CONF.format(echo=ECHO_MODULE, work=self.work, conns=WORKER_CONNECTIONS,
                            upstream=upstream_port, port=self.port, static=static, sleep=sleep)
        self.conf = os.path.join(self.work, "nginx.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.log_path = os.path.join(self.work, "access.log")
        self.proc = subprocess.Popen(["nginx", "-c", self.conf, "-p", self.work],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("nginx did not start (see %s/error.log)" % self.work)
                time.sleep(0.05)

    def worker_cpu_seconds(self) -> float:
        """CPU time of nginx's processes so far (master and worker)."""
        total = 0
        pids = [self.proc.pid]
        try:
            with open("/proc/%d/task/%d/children" % (self.proc.pid, self.proc.pid)) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
        for pid in pids:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
            except OSError:
                continue
        return total / os.sysconf("SC_CLK_TCK")

    def snapshot(self) -> dict:
        """Requests so far, from the access log (a line at each request's
        end, unbuffered), in `s3server.Proxy.snapshot`'s shape (counts by
        method, a GET with a query string as "LIST"; bytes each way), so that
        `Proxy.delta` reads it."""
        out: dict = {"bytes_down": 0, "bytes_up": 0}
        try:
            with open(self.log_path) as f:
                for line in f:
                    method, args, sent, received = line.split()
                    if method == "GET" and args == '"?"':
                        method = "LIST"
                    out[method] = out.get(method, 0) + 1
                    out["bytes_down"] += int(sent)
                    out["bytes_up"] += int(received)
        except FileNotFoundError:
            pass
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: ends open keepalives
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
