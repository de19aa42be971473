"""The credentials an S3 client's requests are signed with: `CredentialKeeper`.

botocore resolves credentials through its chain (environment, the shared
credentials and config files, credential_process, container and instance
roles) and refreshes expiring ones itself: synchronously, in whichever
thread asks (the mount's trio thread, for the chunk engine's signing), with
no time limit (a credential_process that hangs hangs its caller), and it
reads a shared credentials file once. A keeper takes that over for one
client (store/s3.py attaches one to every client it makes):

- credentials are resolved (the whole chain again, so a rotated file or a
  new role session is seen) in a thread of the keeper's, one refresh at a
  time; a credential_process still running after `REFRESH_TIMEOUT` is
  killed (botocore's process provider is given a `Popen` with that limit);
- `frozen(wait)` answers at once with the last good credentials while they
  are more than `EXPIRY_MARGIN` from their expiry, whatever a refresh is
  doing; otherwise it waits at most ``wait`` seconds for the refresh under
  way (the trio thread passes 0: it never waits) and then raises
  `CredentialsUnavailable` (a TransientError: retried like a store that does
  not answer; EREMOTEIO on a mount once the read's deadline passes);
- a refresh starts when none was made yet, when the credentials are within
  `REFRESH_AHEAD` of their expiry (at most once per `AHEAD_INTERVAL`), when
  the shared credentials file changed (size, mtime or inode, looked at at
  most once per `FILE_CHECK_INTERVAL`), when the store answered access
  denied (`denied`, at most once per `DENIED_INTERVAL` for the same key), or when they are
  unusable; after a failed refresh the next starts by itself `RETRY_FIRST`
  seconds later, doubling to `RETRY_CAP`, until one succeeds;
- a failed or slow refresh is logged at WARNING with its cause once per
  episode, and the end of the episode once; `describe` gives the state for
  the mount's stats.
"""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
import time
from typing import Any

import botocore.credentials

from verneuil_fuse.store.base import TransientError

log = logging.getLogger(__name__)

# Longest time of one refresh: a credential_process still running then is
# killed. botocore's own instance-metadata fetches stop at 1 s a try; 10 s
# leaves an SSO or vault helper room for a round trip or two.
REFRESH_TIMEOUT = 10.0
# Credentials this close to their expiry are not used (a request signed now
# must still be valid when the store checks it).
EXPIRY_MARGIN = 60.0
# Expiring credentials are refreshed this long ahead (botocore's advisory
# refresh time), while the old ones keep serving ...
REFRESH_AHEAD = 15 * 60.0
# ... at most this often: a source that only gives credentials shorter than
# REFRESH_AHEAD (a helper handing out 5-minute keys) is not run per request.
AHEAD_INTERVAL = 30.0
# The shared credentials file is looked at (one stat) at most this often.
FILE_CHECK_INTERVAL = 1.0
# An access-denied answer makes the keeper resolve the chain again at most
# this often: a wrong key in a file costs one re-read per interval, not one
# per request.
DENIED_INTERVAL = 10.0
# After a failed refresh, the next one waits this long, doubling up to the cap.
RETRY_FIRST = 1.0
RETRY_CAP = 30.0
# Longest cause quoted in a log line or the stats.
MAX_CAUSE = 300


class CredentialsUnavailable(TransientError):
    """No usable credentials now (a refresh failed, or is slow): the
    request was not sent."""


class _TimedPopen(subprocess.Popen):
    """What botocore's credential_process provider runs the process with: a
    `communicate` that kills it after `REFRESH_TIMEOUT`."""

    def communicate(self, input=None, timeout=None):  # noqa: A002 - Popen's own name
        try:
            return super().communicate(input, timeout=REFRESH_TIMEOUT if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            super().communicate()
            raise TimeoutError("credential_process %s ran for more than %.0fs: killed"
                               % (self.args[0] if isinstance(self.args, list) else self.args, REFRESH_TIMEOUT))


def _signature(path: str | None) -> tuple | None:
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None  # /dev/null (no file): its times move with every write to it
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _frozen_of(credentials: Any) -> Any:
    """The credentials just resolved, as they are: botocore's own
    `get_frozen_credentials` of expiring ones would refresh them again in
    this thread (running a credential_process a second time) whenever they
    expire within its advisory 15 minutes."""
    if isinstance(credentials, botocore.credentials.RefreshableCredentials) and getattr(
            credentials, "_access_key", None):
        return botocore.credentials.ReadOnlyCredentials(
            credentials._access_key, credentials._secret_key, credentials._token)
    return credentials.get_frozen_credentials()  # a deferred one resolves here, once


def _cause(error: BaseException) -> str:
    text = "%s: %s" % (type(error).__name__, error) if str(error) else type(error).__name__
    return text.replace("\n", " ")[:MAX_CAUSE]


class CredentialKeeper:
    """The credentials of one botocore session's client (module docstring).
    ``what`` names the store in messages."""

    def __init__(self, session: Any, what: str):
        self._what = what
        self._resolver = session.get_component("credential_provider")
        for provider in getattr(self._resolver, "providers", ()):
            if isinstance(provider, botocore.credentials.ProcessProvider):
                provider._popen = _TimedPopen
        self._file = os.path.expanduser(session.get_config_variable("credentials_file") or "")
        self._lock = threading.Lock()
        self._frozen: Any = None  # botocore's ReadOnlyCredentials
        self._expiry: float | None = None  # time.time(); None: never expires
        self._refreshing: threading.Event | None = None  # set when the refresh under way ends
        self._started = 0.0  # monotonic start of the refresh under way
        self._reload = False  # resolve again at the next chance (file changed, denied)
        self._failure: str | None = None  # why the last refresh failed (None: it did not)
        self._episode_logged = False
        self._next_try = 0.0  # monotonic: no refresh before (after a failure)
        self._next_ahead = 0.0  # monotonic: no refresh ahead of expiry before
        self._backoff = RETRY_FIRST
        self._file_sig = _signature(self._file)
        self._next_file_check = time.monotonic() + FILE_CHECK_INTERVAL
        self._denied_at = -DENIED_INTERVAL
        self._denied_key: str | None = None  # the key in use at the last re-read for a denial
        self.refreshes = 0
        self.failures = 0

    # ----------------------------------------------------------- callers
    def adopt(self, credentials: Any) -> None:
        """The credentials the client was made with (resolved once at its
        creation, time-limited as any refresh): the first ones served."""
        if credentials is not None:
            self._install(credentials)

    def frozen(self, wait: float = 0.0) -> Any:
        """Credentials to sign a request with now, or `CredentialsUnavailable`."""
        with self._lock:
            usable = self._check_locked()
            if usable is not None:
                return usable
            event = self._refreshing
        if event is not None and wait > 0:
            event.wait(wait)
            with self._lock:
                usable = self._usable_locked()
                if usable is not None:
                    return usable
        with self._lock:
            why = self._failure or ("a refresh is under way for %.1fs" % (time.monotonic() - self._started)
                                    if self._refreshing is not None else "none resolved yet")
        raise CredentialsUnavailable("no usable AWS credentials for %s: %s" % (self._what, why))

    def denied(self) -> None:
        """The store answered access denied: resolve the chain again (a
        rotated key), at most once per `DENIED_INTERVAL` for the same key
        (a key that changed since the last such re-read is news: at once)."""
        now = time.monotonic()
        with self._lock:
            key = self._frozen.access_key if self._frozen is not None else None
            if now - self._denied_at >= DENIED_INTERVAL or key != self._denied_key:
                self._denied_at = now
                self._denied_key = key
                self._reload = True
                self._next_try = min(self._next_try, now)

    def describe(self) -> dict:
        with self._lock:
            return {"ok": self._failure is None and self._usable_locked() is not None,
                    "expires_in": None if self._expiry is None else round(self._expiry - time.time(), 1),
                    "refreshing": self._refreshing is not None, "refreshes": self.refreshes,
                    "failures": self.failures, "last_error": self._failure}

    # ----------------------------------------------------------- inside
    def _usable_locked(self) -> Any:
        if self._frozen is None or (self._expiry is not None and self._expiry - time.time() <= EXPIRY_MARGIN):
            return None
        return self._frozen

    def _check_locked(self) -> Any:
        """The usable credentials (or None), a refresh started if one is due."""
        mono = time.monotonic()
        if mono >= self._next_file_check:
            self._next_file_check = mono + FILE_CHECK_INTERVAL
            sig = _signature(self._file)
            if sig != self._file_sig:
                self._file_sig = sig
                self._reload = True
                self._next_try = min(self._next_try, mono)
        usable = self._usable_locked()
        ahead = (self._expiry is not None and self._expiry - time.time() < REFRESH_AHEAD
                 and mono >= self._next_ahead)
        if (usable is None or self._reload or ahead) and self._refreshing is None and mono >= self._next_try:
            self._start_locked(mono)
        elif self._refreshing is not None and mono - self._started > REFRESH_TIMEOUT and self._failure is None:
            self._failed_locked("the refresh takes more than %.0fs" % REFRESH_TIMEOUT)
        return usable

    def _retry(self) -> None:
        """After a failed refresh: another one, if still needed."""
        with self._lock:
            self._reload = self._reload or self._failure is not None
            self._check_locked()

    def _start_locked(self, mono: float) -> None:
        self._reload = False
        self._next_ahead = mono + AHEAD_INTERVAL
        self._refreshing = threading.Event()
        self._started = mono
        threading.Thread(target=self._refresh, args=(self._refreshing,), name="credentials",
                         daemon=True).start()

    def _refresh(self, done: threading.Event) -> None:
        """In the keeper's thread: resolve the chain again."""
        try:
            credentials = self._resolver.load_credentials()
            if credentials is None:
                raise LookupError("boto3's chain found none (environment, shared files, "
                                  "credential_process, instance role)")
            self._install(credentials)
        except Exception as e:  # noqa: BLE001 - any failure of the chain is the same to callers
            with self._lock:
                self.failures += 1
                wait = self._backoff
                self._next_try = time.monotonic() + wait
                self._backoff = min(RETRY_CAP, self._backoff * 2)
                self._failed_locked(_cause(e))
            retry = threading.Timer(wait, self._retry)  # tried again without waiting for a request
            retry.daemon = True
            retry.start()
        finally:
            with self._lock:
                if self._refreshing is done:
                    self._refreshing = None
            done.set()

    def _install(self, credentials: Any) -> None:
        frozen = _frozen_of(credentials)
        if frozen is None or not frozen.access_key:
            raise LookupError("the credentials resolved have no access key")
        expiry = getattr(credentials, "_expiry_time", None)
        with self._lock:
            self._frozen = frozen
            self._expiry = expiry.timestamp() if expiry is not None else None
            self.refreshes += 1
            log.debug("%s: AWS credentials resolved (%d so far)", self._what, self.refreshes)
            self._backoff = RETRY_FIRST
            if self._failure is not None and self._episode_logged:
                log.warning("%s: AWS credentials resolved again; requests are signed again", self._what)
            self._failure = None
            self._episode_logged = False

    def _failed_locked(self, why: str) -> None:
        self._failure = why
        if not self._episode_logged:
            self._episode_logged = True
            usable = self._usable_locked() is not None
            log.warning("%s: cannot refresh the AWS credentials (%s); %s", self._what, why,
                        "the current ones serve until they expire" if usable
                        else "requests that need them fail (remote I/O error on a mount) until a refresh "
                             "succeeds (tried again in %.0fs at most)" % RETRY_CAP)
