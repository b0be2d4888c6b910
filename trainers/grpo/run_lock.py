"""One writer per run folder: an exclusive lock on ``<out_dir>/.lock`` held while a command writes.

Every command that writes a run folder (``scripts.train``, ``scripts.train_trl``,
``scripts.drift``, ``scripts.train_drafter``) holds ``with RunLock(out_dir, "scripts.train"):``
around its work; read-only commands (``scripts.compare_runs``, ``--from-run`` reports) take
none. Terms:

- **holder**: the process that holds the lock. It writes its record into the lock file as
  JSON: ``host``, ``pid``, ``started`` (UTC, ISO 8601), ``command`` and ``argv``.
- **flock**: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file. The kernel releases it when
  the holder's process ends in any way, SIGKILL included, so a crash never leaves the folder
  locked on the holder's host.
- **stale record**: a record left by a holder that did not remove it (killed with SIGKILL,
  its machine lost). On the same host, a record whose pid no longer runs is taken over with a
  printed note. A record from **another host** cannot be checked from here, and flock does not
  reach across hosts on every network filesystem (NFS without a lock manager, some FUSE
  mounts): such a record refuses the folder, naming the holder and how to clear it.

A second writer is refused at once (:class:`RunLockedError`, a ``ConfigError``: the scripts print
one ``error: ...`` line and exit 2) with the holder's host, pid, start time and command. The
holder removes the file and releases the flock on every exit: a normal return, an exception,
and SIGTERM (turned into ``SystemExit(143)`` while the lock is held, unless the process already
has a SIGTERM handler, such as the one ``ray.init`` installs, which exits the same way).

Locks on different folders are independent, in one process or in several (a study holds its
folder and trains in sub-folders); one process locking the same folder twice is refused. The
lock file descriptor is not inherited by programs the holder starts (Ray workers, subprocesses:
it is opened close-on-exec), but a child the holder forks without exec shares it: if the holder
dies and such a child lives on, the flock stays held, and the refusal says so (the holder's pid
no longer runs) and how to find that process.

Simplification: where flock does not reach across hosts, two writers on two hosts that start
within the same few milliseconds can both find no record; the record then only narrows that
window. On such storage, start one writer per folder.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from rollout.config import ConfigError

LOCK_NAME = ".lock"
_HELD: dict[str, str] = {}  # lock file -> command, of the locks this process holds (a second one is refused)


class RunLockedError(ConfigError):
    """A run folder that another writer holds; the message names the holder and what to do."""

    def __init__(self, out_dir: str | Path, message: str):
        super().__init__("run.out_dir", message)
        self.out_dir = str(out_dir)
        self.args = (message,)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie, dead but not yet reaped, does not)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def describe(record: dict) -> str:
    """``scripts.train (pid 123 on host h, since 2026-...)`` from a lock record."""
    if not record:
        return "a writer whose record is not readable yet"
    return (f"{record.get('command', '?')} (pid {record.get('pid', '?')} on host {record.get('host', '?')}, "
            f"since {record.get('started', '?')})")


class RunLock:
    """``with RunLock(out_dir, command):`` holds ``<out_dir>/.lock`` (see the module doc); the folder
    is created if needed. Raises :class:`RunLockedError` when another writer holds it."""

    def __init__(self, out_dir: str | Path, command: str):
        self.out_dir = Path(os.path.expanduser(str(out_dir)))
        self.path = self.out_dir / LOCK_NAME
        self.command = command
        self.record: dict = {}
        self.takeover: dict | None = None  # the stale record taken over, if any
        self._fd: int | None = None
        self._sigterm = None  # the SIGTERM handler in place before ours, when ours is installed

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> RunLock:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        key = str(self.path.resolve())
        if key in _HELD:
            raise RunLockedError(self.out_dir, f"run folder {self.out_dir} is already held by this process "
                                 f"({_HELD[key]}, pid {os.getpid()}): one writer per folder")
        fd = self._open_locked()
        try:
            old = _read(fd)
            self._check_record(old)
            self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(),
                           "command": self.command, "argv": list(sys.argv)}
            data = (json.dumps(self.record) + "\n").encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _HELD[key] = self.command
        if old and self.takeover is not None:
            print(f"note: took over the lock of {self.out_dir}: its holder {describe(old)} no longer runs "
                  "(it ended without releasing it)", file=sys.stderr, flush=True)
        self._install_sigterm()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock file and release the flock (idempotent)."""
        if self._fd is None:
            return
        self._restore_sigterm()
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None
            _HELD.pop(str(self.path.resolve()), None)

    # ------------------------------------------------------------------ the lock itself
    def _open_locked(self) -> int:
        """A descriptor of the lock file holding its flock; refuses when another process holds it.
        A file removed by its releasing holder between our open and our flock is opened again
        (the flock would lock a file no one else sees)."""
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited (O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read(fd)
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                text = self._refusal(holder)
                if holder.get("host") == socket.gethostname() and not pid_alive(holder.get("pid")):
                    text = (f"run folder {self.out_dir} is in use: its writer {describe(holder)} no longer runs, but "
                            f"a process it forked still holds {self.path} open (its lock with it); find it with "
                            f"`fuser -v {self.path}`, stop it, and run again")
                raise RunLockedError(self.out_dir, text) from None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)
        raise RunLockedError(self.out_dir, f"run folder {self.out_dir}: its lock file {self.path} keeps being "
                             "replaced (another writer starting and stopping); try again")

    def _check_record(self, old: dict) -> None:
        """With the flock held: refuse a record whose holder may still run (another host, or a
        live pid on this one, which means flock does not work on this storage); a record whose
        holder is gone is taken over."""
        if not old:
            return
        pid = old.get("pid")
        if old.get("host") != socket.gethostname():
            raise RunLockedError(self.out_dir, self._refusal(old) + "; that host cannot be checked from here: if "
                                 f"the process no longer runs (killed, or its machine lost), remove {self.path}")
        if pid == os.getpid() or not pid_alive(pid):  # our own pid: a record from an earlier life of this pid
            self.takeover = old
            return
        raise RunLockedError(self.out_dir, self._refusal(old) + f"; if pid {pid} is another program (the pid was "
                             f"reused), remove {self.path}")

    def _refusal(self, holder: dict) -> str:
        host = holder.get("host")
        where = "" if host in (None, socket.gethostname()) else f" on host {host}"
        return (f"run folder {self.out_dir} is in use: {describe(holder)} writes to it (lock file {self.path}); "
                f"wait for it to finish, stop it (kill {holder.get('pid', '?')}{where}), or use another output folder")

    # ------------------------------------------------------------------ SIGTERM
    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._sigterm is None:
            return
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._sigterm)
        self._sigterm = None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _read(fd: int) -> dict:
    """The record in the lock file (``{}`` when empty or not a JSON object: being written, or foreign)."""
    try:
        data = os.pread(fd, 65536, 0)
        record = json.loads(data.decode()) if data.strip() else {}
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
