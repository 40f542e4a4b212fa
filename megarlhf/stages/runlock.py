"""One run per run directory: ``RUN_DIR/LOCK`` names its owner (host, pid, start time,
Slurm job). The job's first rank takes it before any work; a second run in the same
directory is refused naming the owner. A lock whose owner is gone - its process no longer
exists on this host, or, from another host, it has not been refreshed for
:data:`STALE_S` seconds (the owner touches it every :data:`REFRESH_S`) - is taken over
with a message saying so. An owner on another host whose lock is still fresh cannot be
checked (its host may have died with it: a Slurm job requeued after a node failure, or a
new job after a crash, lands elsewhere): this run waits, saying so, until the lock goes
stale - then takes it over - or is refreshed, which proves the owner alive - then is
refused. Released at a normal exit; a killed run leaves it for the next run to take over.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time

LOCK_FILE = "LOCK"
REFRESH_S = 15.0
STALE_S = 90.0

_held: dict = {}


class RunLocked(ValueError):
    """Another live run owns the directory."""


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a reused pid apart), or None when there is
    no such process (or only its zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "process_start": _process_start(os.getpid()),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT")}


def _describe(owner: dict) -> str:
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (f"host {owner.get('host')}, pid {owner.get('pid')}, started "
            f"{owner.get('started')}{job}")


def _gone(owner: dict, path: str) -> str | None:
    """Why the lock's owner is gone, or None while it may be alive."""
    if owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        start = _process_start(pid) if isinstance(pid, int) else None
        if start is None:
            return "its process no longer exists"
        if owner.get("process_start") not in (None, start):
            return "its process no longer exists (the pid was reused)"
        return None
    age = time.time() - os.path.getmtime(path)
    if age > STALE_S:
        return f"the lock was last refreshed {age:.0f} s ago (host {owner.get('host')})"
    return None


def _wait_for_stale(path: str, owner: dict, log) -> str | None:
    """An owner on another host, its lock fresh: wait until the lock goes stale (why it is
    gone) or is refreshed (None: the owner lives). At most :data:`STALE_S` plus a refresh."""
    try:
        seen = os.path.getmtime(path)
    except OSError:
        return "the lock was removed while this run looked at it"
    wait = max(0.0, seen + STALE_S - time.time()) + 1.0
    log(f"[megarlhf] {path} is held by a run on another host ({_describe(owner)}), which "
        f"this host cannot check (its host may have died with it): waiting up to "
        f"{wait:.0f} s for the lock to go stale or be refreshed")
    until = time.monotonic() + wait
    while time.monotonic() < until:
        time.sleep(min(1.0, wait / 10))
        try:
            now = os.path.getmtime(path)
        except OSError:
            return "the lock was removed while this run waited"
        if now != seen:
            return None  # refreshed: the owner lives
    age = time.time() - seen
    return f"the lock was last refreshed {age:.0f} s ago (host {owner.get('host')})"


def acquire(run_dir: str, log=print) -> None:
    """Take ``run_dir``'s lock for this process (the job's first rank calls it)."""
    if _held.get("dir") == run_dir:
        return
    path = os.path.join(run_dir, LOCK_FILE)
    mine = _owner()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, json.JSONDecodeError):
                owner = {}
            if not isinstance(owner, dict):
                owner = {}
            if not owner:  # torn by a crash while being written: nobody owns it
                why = "the lock file is empty or damaged"
            else:
                why = _gone(owner, path)
            if why is None and owner.get("host") != socket.gethostname():
                why = _wait_for_stale(path, owner, log)
            if why is None:
                raise RunLocked(
                    f"the run directory {run_dir} is in use by another run ({_describe(owner)})"
                    f": wait for it to finish, stop it, or set run.name / run.output_dir to "
                    f"another directory ({path} records the owner)")
            log(f"[megarlhf] taking over {path} from the run that held it "
                f"({_describe(owner) if owner else 'unknown owner'}): {why}")
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        _held.update(dir=run_dir, path=path, stop=threading.Event())
        threading.Thread(target=_refresh, args=(path, _held["stop"]), daemon=True,
                         name="megarlhf-runlock").start()
        atexit.register(release)
        return
    raise RunLocked(f"could not take {path}: another run keeps taking it")


def _refresh(path: str, stop: threading.Event) -> None:
    while not stop.wait(REFRESH_S):
        try:
            os.utime(path)
        except OSError:
            return


def release() -> None:
    """Give the lock back (at a normal exit)."""
    if not _held:
        return
    _held["stop"].set()
    try:
        with open(_held["path"]) as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(_held["path"])
    except (OSError, json.JSONDecodeError, AttributeError):
        pass
    _held.clear()
