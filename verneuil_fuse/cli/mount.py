"""``verneuil SOURCE MOUNTPOINT [-o OPTIONS] [-f]``: mount a store's replicas.

Works as a mount helper: ``mount -t fuse.verneuil SOURCE /mnt -o OPTIONS``
and the fstab line ``SOURCE /mnt fuse.verneuil ro,allow_other,_netdev,nofail 0 0``
make mount.fuse3 run ``verneuil SOURCE /mnt -o OPTIONS,dev,suid`` (the
program must be on mount.fuse3's fixed PATH: scripts/install-mount-helper.sh).

Start-up: the program forks; the child opens the store, lists it once (with
``start_retry=``, again while the store cannot be reached), mounts
and only then tells the parent, which exits 0 (or prints the child's one-line
error and exits non-zero), so mount(8) returns once the mount is live. The
child serves until ``umount``/``fusermount3 -u`` or SIGTERM/SIGINT, then
unmounts and exits 0. ``-f`` does all of it in the foreground.

The command line and its options are `mount_options`' (one table of them);
this module checks the paths and the source, sets up logging, builds the
layers a mount serves from (disk cache, fetcher, catalog, followers, the
follow loop, FUSE operations), serves and tears them down.
"""
from __future__ import annotations

import errno
import logging
import logging.handlers
import os
import re
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from verneuil_fuse.cli.mount_options import (DEFAULT_CACHE_SIZE, DEFAULT_READ_AHEAD_KB, S3_ONLY_OPTIONS, Options,
                                             parse_args)
from verneuil_fuse.errors import EXIT_INTERRUPTED, EXIT_MOUNT, EXIT_SOURCE, EXIT_USAGE, UserError
from verneuil_fuse.logs import formatter
from verneuil_fuse.reader.fetcher import DEFAULT_CONCURRENCY
from verneuil_fuse.reader.replica import PrefetchConfig

if TYPE_CHECKING:  # annotations only: `serve` imports these itself, so pyfuse3 loads only to mount
    from verneuil_fuse.fs import VerneuilFS
    from verneuil_fuse.metrics import MetricsServer
    from verneuil_fuse.reader.cache import ChunkCache
    from verneuil_fuse.reader.catalog import Catalog
    from verneuil_fuse.reader.fetcher import Fetcher
    from verneuil_fuse.reader.watch import Watch
    from verneuil_fuse.store import Store

log = logging.getLogger(__name__)

# At unmount, chunks already downloaded are still written to the disk cache
# for at most this long: a GET paid for is not thrown away (a scan that ends
# just before an unmount left some 90 chunks unwritten, fetched again by the
# next mount), but a disk too slow to take them does not hold the process.
CACHE_DRAIN_S = 5.0
# Allocations between two collections of young objects by Python's cyclic
# collector (its default: 700); see `_run`. Short-lived objects are freed by
# their reference counts long before a collection at 10,000 sees them.
GC_YOUNG_THRESHOLD = 10_000

# Waits between attempts to list an unreachable store at start
# (`start_retry`): the first comes soon, as a network being brought up at
# boot often is within a second; doubling, they stay few in a long outage;
# the cap keeps the mount within 10 s of the store coming back.
START_RETRY_FIRST_S = 1.0
START_RETRY_MAX_S = 10.0

# How long a background mount's parent waits for the filesystem process to
# report the mount up, on top of `start_retry`: time to import, open the
# store, list it (a few slow attempts) and mount.
READY_WAIT_S = 120.0

# Where a daemonized mount logs by default, and where it logs when that
# socket is missing (containers, minimal systems): as root, beside the
# system's other logs.
SYSLOG_SOCKET = "/dev/log"
ROOT_LOG_DIR = "/var/log/verneuil"
# Another directory for those default log files (a service's own log
# directory; the tests' temporary one).
LOG_DIR_ENV = "VERNEUIL_LOG_DIR"


# ---------------------------------------------------------------- logging
def setup_logging(opts: Options, daemon: bool) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    if opts.log_file:
        handler: logging.Handler = logging.FileHandler(opts.log_file)
        handler.setFormatter(formatter("verneuil", module=True))
    elif daemon:
        # run_background chose a log file when there is no syslog socket.
        handler = logging.handlers.SysLogHandler(SYSLOG_SOCKET)
        handler.setFormatter(logging.Formatter("verneuil[%(process)d]: %(levelname)s %(module)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(formatter("verneuil", sys.stderr, module=True))
    root.addHandler(handler)
    root.setLevel(opts.log_level.upper())
    # botocore's debug output holds request headers (the access key id, a
    # session token): never below INFO, whatever log_level says; and its INFO
    # lines (where it found credentials) only at log_level=debug.
    third_party = logging.INFO if root.level < logging.INFO else max(logging.WARNING, root.level)
    for name in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(name).setLevel(third_party)


def default_log_file(mountpoint: str) -> str:
    """Where a daemonized mount logs when there is no syslog: one file per
    mount point, named after it with ``/`` as ``-`` (``/mnt/my-replicas``
    logs to ``mnt-my-replicas.log``, ``/`` to ``root.log``)."""
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    if os.environ.get(LOG_DIR_ENV):
        top = os.environ[LOG_DIR_ENV]
    elif os.getuid() == 0:
        top = ROOT_LOG_DIR
    else:
        top = os.path.join(os.path.expanduser("~"), ".cache", "verneuil", "log")
    return os.path.join(top, name + ".log")


def choose_log_file(opts: Options) -> str | None:
    """Before a daemonized mount detaches: make ``log_file`` absolute (the
    daemon works from ``/``) and, with no syslog socket to log to, pick the
    default log file, so that no log line is lost. Returns the line that
    names it, for stderr once the mount is up (an error is one line)."""
    if opts.log_file:
        opts.log_file = os.path.abspath(opts.log_file)
        return None
    if os.path.exists(SYSLOG_SOCKET):
        return None
    path = default_log_file(opts.mountpoint)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise UserError("no syslog (%s) and cannot write the log file %s: %s; give log_file=PATH"
                        % (SYSLOG_SOCKET, path, e.strerror or e), EXIT_USAGE) from None
    opts.log_file = path
    return "verneuil: no syslog (%s): logging to %s" % (SYSLOG_SOCKET, path)


# ------------------------------------------------------------------ checks
def shown(source: str) -> str:
    """The source as messages show it: a URL's user:password@ is masked (the
    store refuses credentials in URLs, and says so without repeating them)."""
    return re.sub(r"(//)[^/@\s]*@", r"\1***@", source)


def check_source(opts: Options):
    """Open the store (UserError on a bad spec or missing directory). A
    directory store is opened without creating anything: a mount is
    read-only, and a mistyped path must not grow chunks/ and manifests/."""
    from verneuil_fuse.store import ConfigError, open_store, parse_config, store_target

    try:
        target = store_target(parse_config(opts.source))
        if target.get("kind") == "directory":
            given = [name for name, value in zip(S3_ONLY_OPTIONS, (opts.profile, opts.credentials_file)) if value]
            if given:
                raise UserError("option%s %s appl%s to S3 stores only, not to the directory store %s"
                                % ("s" if len(given) > 1 else "", " and ".join(given),
                                   "y" if len(given) > 1 else "ies", shown(opts.source)), EXIT_USAGE)
            path = target["path"]
            if not os.path.isdir(path):
                raise UserError("source %s: no such directory %s" % (shown(opts.source), path), EXIT_SOURCE)
            if not os.path.isdir(os.path.join(path, "manifests")):
                raise UserError("source %s: %s is not a store (no manifests/ directory in it)"
                                % (shown(opts.source), path), EXIT_SOURCE)
            return open_store({"directory": {"path": path, "create": False}})
        s3_options = {}
        if target.get("kind") == "s3":
            if opts.credentials_file:
                try:
                    with open(opts.credentials_file, "rb"):
                        pass
                except OSError as e:
                    raise UserError("cannot read credentials_file %s: %s"
                                    % (opts.credentials_file, e.strerror or e), EXIT_USAGE) from None
            s3_options = {"max_pool_connections": (opts.concurrency or DEFAULT_CONCURRENCY) * 2 + 8, "max_attempts": 2,
                          "profile": opts.profile, "credentials_file": opts.credentials_file}
        return open_store(opts.source, **s3_options)
    except ConfigError as e:
        raise UserError("bad source %s: %s" % (shown(opts.source), e), EXIT_SOURCE) from None


def check_paths(opts: Options) -> None:
    """Check the mount point and the log file; make every path absolute (the
    daemon runs in /), the mount point without symlinks (as the kernel
    records it in mountinfo)."""
    def stale() -> UserError:
        return UserError("mount point %s is a stale FUSE mount (its process is gone): run "
                         "fusermount3 -u %s first" % (opts.mountpoint, opts.mountpoint), EXIT_MOUNT)

    try:
        os.stat(opts.mountpoint)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise stale() from None
    if not os.path.isdir(opts.mountpoint):
        raise UserError("mount point %s is not a directory" % opts.mountpoint, EXIT_USAGE)
    opts.mountpoint = os.path.realpath(opts.mountpoint)
    if _mount_device(opts.mountpoint) is not None:
        try:
            os.listdir(opts.mountpoint)
        except OSError as e:
            if e.errno == errno.ENOTCONN:
                raise stale() from None
        raise UserError("%s is already a mount point (umount it first)" % opts.mountpoint, EXIT_MOUNT)
    if opts.source.startswith("@") and not opts.source.startswith("@/"):
        opts.source = "@" + os.path.abspath(opts.source[1:])
    opts.cache_dir, opts.log_file, opts.credentials_file = (
        os.path.abspath(path) if path else path for path in (opts.cache_dir, opts.log_file, opts.credentials_file))
    if opts.log_file:
        try:
            with open(opts.log_file, "a"):
                pass
        except OSError as e:
            raise UserError("cannot write log_file %s: %s" % (opts.log_file, e.strerror or e),
                            EXIT_USAGE) from None


def _mount_device(mountpoint: str) -> str | None:
    """MAJ:MIN of the mount at ``mountpoint``, from /proc/self/mountinfo (the
    mount point itself is never touched from inside the filesystem process)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == mountpoint:
                found = fields[2]  # the last (topmost) mount wins
    return found


async def tune_kernel_readahead(mountpoint: str, kb: int, explicit: bool) -> None:
    """Set the mount's readahead once the kernel has the FUSE INIT reply:
    the reply caps the readahead at its ``max_readahead`` (128 KiB with
    libfuse's defaults), so a value written before it would be lost. A
    ``stat`` of the mount point from a worker thread returns only after the
    kernel processed INIT (it queues every request until then)."""
    import trio

    try:
        with trio.fail_after(30):
            await trio.to_thread.run_sync(os.stat, mountpoint, abandon_on_cancel=True)
    except (OSError, trio.TooSlowError) as e:
        log.warning("cannot set read_ahead_kb for %s: %s", mountpoint, e)
        return
    set_kernel_readahead(mountpoint, kb, explicit)


def set_kernel_readahead(mountpoint: str, kb: int, explicit: bool = True) -> None:
    """Write the mount's read_ahead_kb (needs root; without it, a warning if
    the user asked for a value, an info line for the default)."""
    dev = _mount_device(mountpoint)
    if dev is None:
        log.warning("cannot find the mount %s in /proc/self/mountinfo", mountpoint)
        return
    try:
        with open("/sys/class/bdi/%s/read_ahead_kb" % dev, "w") as f:
            f.write("%d\n" % kb)
        log.info("read_ahead_kb=%d for %s", kb, mountpoint)
    except OSError as e:
        log.log(logging.WARNING if explicit else logging.INFO,
                "cannot set read_ahead_kb for %s: %s", mountpoint, e)


# ------------------------------------------------------------------- serve
async def first_listing(opts: Options, catalog) -> None:
    """The catalog's first poll; while the store cannot be reached
    (TransientError: refused, timed out, 5xx) it is tried again, with
    backoff, for up to ``start_retry`` seconds, then the last error raised.
    Other errors (no bucket, access denied) are raised at once."""
    import trio

    from verneuil_fuse.store import TransientError

    deadline = trio.current_time() + opts.start_retry
    delay = START_RETRY_FIRST_S
    while True:
        try:
            await catalog.refresh(raise_errors=True)
            return
        except TransientError as e:
            left = deadline - trio.current_time()
            if left <= 0:
                raise
            wait = min(delay, left)
            log.warning("cannot list %s: %s; trying again in %.0fs (start_retry: %.0fs left)",
                        shown(opts.source), e, wait, left)
            await trio.sleep(wait)
            delay = min(delay * 2, START_RETRY_MAX_S)


@dataclass
class _Layers:
    """What a mount serves from, built by `_build_layers` and torn down by
    `_tear_down`, with the state of the mount itself."""
    store: Store
    cache: ChunkCache | None  # None with cache_size=0
    fetcher: Fetcher
    catalog: Catalog
    ops: VerneuilFS
    watch: Watch  # the follow loop
    ready: bool = False    # the mount is up and tuned: the stats' "ready"
    mounted: bool = False  # pyfuse3.init succeeded and pyfuse3.close is still to come
    metrics: MetricsServer | None = None  # metrics_port's endpoint
    started: float = field(default_factory=time.time)


async def serve(opts: Options, store, ready) -> None:
    """Build the layers, list the store, mount, call ``ready()``, serve until
    an unmount or a signal, then unmount and close everything."""
    layers = _build_layers(opts, store)
    try:
        await _serve_layers(opts, layers, ready)
    finally:
        _tear_down(opts, layers)


def _default_cache_size(opts: Options, store) -> int:
    """The disk cache's bound when ``cache_size`` is not given: none for a
    directory store on this machine's own disks, unless ``cache_dir`` or
    ``hydrate`` asks for one (its chunk files are read at the disk's speed
    already, and a cache would write every byte twice: docs/READER.md, "The
    disk cache"), else `DEFAULT_CACHE_SIZE`."""
    files = store.chunks.capabilities().files
    if opts.cache_dir is None and not opts.hydrate and files is not None and files.on_local_disk():
        log.info("no disk cache: the directory store is on a local disk (cache_size= or cache_dir= for one)")
        return 0
    return DEFAULT_CACHE_SIZE


def _open_disk_cache(opts: Options, store) -> ChunkCache | None:
    """The chunk cache in cache_dir, or None with cache_size=0 (or by
    default, `_default_cache_size`)."""
    from verneuil_fuse.reader.cache import ChunkCache, default_cache_dir

    size = opts.cache_size if opts.cache_size is not None else _default_cache_size(opts, store)
    if size <= 0:
        return None
    cache_dir = opts.cache_dir or default_cache_dir()
    try:
        return ChunkCache(cache_dir, size)
    except OSError as e:
        raise UserError("cannot use cache_dir %s: %s" % (cache_dir, e.strerror or e), EXIT_USAGE) from None


def _prefetch_config(opts: Options) -> PrefetchConfig:
    """The readahead and B-tree prefetch of the options (a window of 0
    turns its kind of prefetch off)."""
    return PrefetchConfig(
        readahead=opts.readahead and opts.readahead_max > 0,
        btree=opts.btree_prefetch and opts.btree_max > 0,
        readahead_max=max(1, opts.readahead_max),
        btree_max=max(1, opts.btree_max),
    )


def _build_layers(opts: Options, store) -> _Layers:
    """Disk cache, fetcher, catalog and FUSE operations over ``store``."""
    from verneuil_fuse.fs import VerneuilFS
    from verneuil_fuse.reader.catalog import Catalog
    from verneuil_fuse.reader.fetcher import Fetcher
    from verneuil_fuse.reader.follow import Followers
    from verneuil_fuse.reader.watch import Watch

    cache = _open_disk_cache(opts, store)
    fetcher = Fetcher(
        store,
        cache,
        concurrency=opts.concurrency,
        prefetch_concurrency=opts.prefetch_concurrency,
        mem_cache_bytes=opts.mem_cache,
        retries=opts.retries,
        timeout=opts.timeout,
        deadline=opts.deadline,
        max_db_size=opts.max_db_size,
    )
    catalog = Catalog(fetcher, refresh_interval=opts.refresh, prefetch=_prefetch_config(opts),
                      hydrate=opts.hydrate, manifest_cache=_open_manifest_cache(cache, store),
                      extra_stats=lambda: _mount_stats(opts, layers), subdir=opts.subdir)
    followers = Followers(catalog) if opts.follow else None
    ops = VerneuilFS(catalog, entry_timeout=opts.entry_timeout, uid=opts.uid, gid=opts.gid, umask=opts.umask,
                     followers=followers)
    layers = _Layers(store, cache, fetcher, catalog, ops, Watch(catalog, opts.follow_interval))
    return layers


def _open_manifest_cache(cache: ChunkCache | None, store):
    """The manifests kept on disk beside the chunk cache (`reader/manifests.py`);
    None without a disk cache, or when it cannot be opened (the store stays
    the source of manifests)."""
    from verneuil_fuse.reader.manifests import ManifestCache

    if cache is None:
        return None
    try:
        return ManifestCache(cache.directory, store.url)
    except Exception as e:  # noqa: BLE001 - a mount without it still serves
        log.warning("no manifest cache in %s: %s", cache.directory, e)
        return None


def _mount_stats(opts: Options, layers: _Layers) -> dict:
    """The mount's own sections, "mount" and "follow", of the catalog's
    stats (/.verneuil/stats): the catalog asks on every read of them, so
    the values are current ones."""
    return {
        "mount": {"source": layers.store.url, "mountpoint": opts.mountpoint, "pid": os.getpid(),
                  "started": layers.started,
                  "read_errors": layers.ops.read_errors, "handler_errors": layers.ops.handler_errors,
                  "ready": layers.ready,
                  "cache_dir": layers.cache.directory if layers.cache is not None else None,
                  "metrics_url": layers.metrics.url if layers.metrics is not None else None},
        "follow": layers.watch.stats(layers.ops.followers),
    }


async def _serve_layers(opts: Options, layers: _Layers, ready) -> None:
    """List the store, mount, serve until ``pyfuse3.main`` returns, unmount,
    then let the disk cache writes of chunks already downloaded finish, for
    at most CACHE_DRAIN_S (the flights are cancelled, nothing is mounted)."""
    import pyfuse3
    import trio

    async with trio.open_nursery() as writes:
        async with trio.open_nursery() as nursery:
            layers.fetcher.bind(nursery, writes)
            layers.catalog.bind(nursery)
            _serve_metrics(opts, layers)
            await _list_store(opts, layers.catalog)
            _start_fuse(opts, layers)
            nursery.start_soon(_settle, opts, layers, ready)
            nursery.start_soon(_unmount_on_signal)
            nursery.start_soon(layers.catalog.run)
            nursery.start_soon(layers.watch.run)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()
        _unmount(opts, layers)
        writes.cancel_scope.deadline = trio.current_time() + CACHE_DRAIN_S


def _serve_metrics(opts: Options, layers: _Layers) -> None:
    """With metrics_port: serve the metrics over HTTP from a thread of its
    own, each scrape rendered in trio's thread (the catalog's own); a port
    that cannot be had is a usage error, before anything is mounted."""
    import trio

    from verneuil_fuse.metrics import MetricsServer

    if opts.metrics_port is None:
        return
    token = trio.lowlevel.current_trio_token()

    def render() -> bytes:
        return trio.from_thread.run_sync(layers.catalog.render_metrics, trio_token=token)

    try:
        layers.metrics = MetricsServer(render, opts.metrics_port, opts.metrics_address)
    except OSError as e:
        raise UserError("cannot serve metrics on %s:%d: %s" % (opts.metrics_address, opts.metrics_port,
                                                             e.strerror or e), EXIT_USAGE) from None


async def _list_store(opts: Options, catalog: Catalog) -> None:
    """The first listing (`first_listing`); a store error as a UserError."""
    from verneuil_fuse.store import StoreError

    try:
        await first_listing(opts, catalog)
    except StoreError as e:
        raise UserError("cannot list %s: %s" % (shown(opts.source), e), EXIT_SOURCE) from None


def _start_fuse(opts: Options, layers: _Layers) -> None:
    """Mount the file system (pyfuse3.init); a failure as a UserError."""
    import pyfuse3

    try:
        pyfuse3.init(layers.ops, opts.mountpoint, opts.fuse)
    except RuntimeError as e:
        raise UserError("cannot mount %s: %s" % (opts.mountpoint, e), EXIT_MOUNT) from None
    layers.mounted = layers.ops.mounted = True


async def _settle(opts: Options, layers: _Layers, ready) -> None:
    """Once mounted: tune the kernel's readahead, then mark the mount ready
    and call ``ready()``. Readahead first: a file opened before the tuning
    would keep the 128 KiB readahead while it is open."""
    if opts.read_ahead_kb is None:
        await tune_kernel_readahead(opts.mountpoint, DEFAULT_READ_AHEAD_KB, False)
    else:
        await tune_kernel_readahead(opts.mountpoint, opts.read_ahead_kb, True)
    log.info("mounted %s on %s (%d databases)", layers.store.url, opts.mountpoint,
             len(layers.catalog.entries))
    layers.ready = True
    ready()


async def _unmount_on_signal() -> None:
    """End ``pyfuse3.main`` (and so the mount) at the first SIGTERM, SIGINT
    or SIGHUP."""
    import pyfuse3
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return


def _unmount(opts: Options, layers: _Layers) -> None:
    """Unmount, if mounted and not unmounted yet."""
    if not layers.mounted:
        return
    import pyfuse3

    layers.mounted = False
    pyfuse3.close(unmount=True)
    log.info("unmounted %s", opts.mountpoint)


def _tear_down(opts: Options, layers: _Layers) -> None:
    """However serving ended: unmount if still mounted, close the disk cache
    and the store."""
    _unmount(opts, layers)
    if layers.metrics is not None:
        layers.metrics.close()
    if layers.cache is not None:
        layers.cache.close()
    if layers.catalog.manifest_cache is not None:
        layers.catalog.manifest_cache.close()
    layers.store.close()


def _run(opts: Options, ready) -> int:
    import gc

    import trio

    store = check_source(opts)
    # Every read makes a few short-lived objects per chunk (flights, parts,
    # answers): at Python's default threshold (700 allocations) the cyclic
    # collector took about 6 % of trio's thread in a cold scan, and each of
    # its rarer full passes walks the whole catalog of a large mount.
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    try:
        trio.run(serve, opts, store, ready)
    except BaseExceptionGroup as group:
        users, _ = group.split(UserError)
        while isinstance(users, BaseExceptionGroup):
            users = users.exceptions[0]
        if users is not None:
            raise users from None
        if group.split(KeyboardInterrupt)[0] is not None:
            raise KeyboardInterrupt from None
        raise
    return 0


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, text[0] if text else "")


def run_background(opts: Options, wait: float | None = None) -> int:
    if wait is None:
        wait = READY_WAIT_S + opts.start_retry
    where_logs = choose_log_file(opts)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the filesystem process
        os.close(r)
        code = 0
        try:
            os.setsid()
            os.chdir("/")
            setup_logging(opts, daemon=True)

            def ready() -> None:
                os.write(w, b"K")
                os.close(w)
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.close(devnull)

            _run(opts, ready)
        except UserError as e:
            _tell(w, "E%d %s" % (e.exit_code, e))
            code = e.exit_code
        except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
            log.exception("verneuil failed")
            _tell(w, "E1 %s" % _one_line(e))
            code = 1
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + wait
    msg = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGTERM)
                raise UserError("gave up waiting %.0fs for the mount to come up" % wait, EXIT_MOUNT)
            readable, _, _ = select.select([r], [], [], left)
            if readable:
                chunk = os.read(r, 4096)
                if not chunk:
                    break
                msg += chunk
                if msg.startswith(b"K"):
                    break
    except KeyboardInterrupt:
        # The filesystem process stops too (it unmounts if it got that far).
        os.kill(pid, signal.SIGTERM)
        raise UserError("interrupted: not mounted", EXIT_INTERRUPTED) from None
    finally:
        os.close(r)
    if msg.startswith(b"K"):
        if where_logs:
            print(where_logs, file=sys.stderr)
        return 0
    _, status = os.waitpid(pid, 0)
    if msg.startswith(b"E"):
        code_text, _, text = msg[1:].decode(errors="replace").partition(" ")
        raise UserError(text, int(code_text) if code_text.isdigit() else 1)
    raise UserError("the filesystem process died (wait status %d)" % status, EXIT_MOUNT)


def _tell(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode(errors="replace")[:4000])
        os.close(fd)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
        check_paths(opts)
        if opts.foreground:
            setup_logging(opts, daemon=False)
            try:
                return _run(opts, lambda: None)
            except KeyboardInterrupt:
                # Once mounted, SIGINT unmounts and returns 0 (serve's signal
                # receiver); here it came before the mount was made.
                raise UserError("interrupted: not mounted", EXIT_INTERRUPTED) from None
        return run_background(opts)
    except UserError as e:
        print("verneuil: error: %s" % e, file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
