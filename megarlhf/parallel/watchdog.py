"""The watchdog: a rank that stops answering (stopped, killed without a trace, its node
lost) is noticed by every other rank within ``parallel.timeout_minutes``, which then exit
with a message naming the phase each was in and the ranks that went quiet - instead of
waiting forever in a collective.

Each rank runs a thread that writes a heartbeat (a counter) to the job's rendezvous store
every few seconds and reads the others'. A heartbeat that has not changed for the
deadline - measured on this rank's own clock, so hosts need not agree on the time - or a
store that no longer answers for as long (its host, rank 0, stopped) ends this process:
the message goes to stderr, ``RUN_DIR/STALLED`` is left for ``slurm/launch.sh`` (which
requeues the job as after a preemption) and the process exits with :data:`EXIT_CODE`. The
last checkpoint is untouched: a save writes a new folder and moves ``latest`` last.

Phases (:func:`phase`) only label the message; the stages name the steps that wait on
other ranks (sampling, the experience passes, the updates, resharding, saving, loading,
evaluation).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import threading
import time

EXIT_CODE = 75  # EX_TEMPFAIL: the job may be run again
MARKER = "STALLED"
_PREFIX = "megarlhf/heartbeat/"
_HOST = "megarlhf/host/"

_state = {"phase": "start-up", "run_dir": None, "timeout": datetime.timedelta(minutes=30)}
_watch: "_Watch | None" = None


@contextlib.contextmanager
def phase(name: str, *, deadline_s: float | None = None, setting: str = "",
          waits_on: tuple[str, list[int]] | None = None):
    """Label what this rank is doing, for the watchdog's message. ``deadline_s``: the phase
    may last that long (``setting`` names where it is set); past it the watchdog ends the
    process as for a stall, naming the phase and ``waits_on`` - (what the ranks are, e.g.
    'the rollout side', their job ranks) - and whether they still send heartbeats. A phase
    inside it keeps its deadline."""
    before, deadline = _state["phase"], _state.get("deadline")
    _state["phase"] = name
    if deadline_s is not None:
        _state["deadline"] = (name, time.monotonic(), deadline_s, setting, waits_on)
    try:
        yield
    except BaseException:
        _state.setdefault("failed_in", name)  # the innermost phase the error left
        raise
    finally:
        _state["phase"], _state["deadline"] = before, deadline


def labelled(name: str):
    """Decorator: the function runs as phase ``name``."""
    def wrap(fn):
        import functools

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)
        return inner
    return wrap


def current_phase() -> str:
    return _state["phase"]


def set_run_dir(path: str) -> None:
    """Where a stall leaves its marker (the run directory)."""
    _state["run_dir"] = path


class _Watch:
    def __init__(self, store, rank: int, world: int, deadline_s: float, interval_s: float):
        self.store, self.rank, self.world = store, rank, world
        self.deadline, self.interval = deadline_s, interval_s
        self.seen: dict = {}  # rank -> (its last heartbeat, when it last moved)
        self.hosts: dict[int, str] = {rank: socket.gethostname()}  # rank -> its host
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="megarlhf-watchdog", daemon=True)

    def _run(self) -> None:
        beat = 0
        now = time.monotonic()
        seen = self.seen = {r: (None, now) for r in range(self.world) if r != self.rank}
        store_ok = now
        while not self.stop.wait(self.interval):
            now = time.monotonic()
            beat += 1
            try:
                if beat == 1:
                    self.store.set(f"{_HOST}{self.rank}", self.hosts[self.rank])
                self.store.set(f"{_PREFIX}{self.rank}", str(beat))
                values = [self._get(f"{_PREFIX}{r}") for r in seen]
                for r in seen:  # each rank's host, for the messages (once each)
                    if r not in self.hosts and (host := self._get(f"{_HOST}{r}")) is not None:
                        self.hosts[r] = host.decode()
                store_ok = now
            except Exception:  # the store's host went quiet (or the job is ending)
                if self.stop.is_set():
                    return
                if now - store_ok > self.deadline:
                    self._abort([0], "the rendezvous store (on rank 0) stopped answering")
                continue
            for r, value in zip(list(seen), values):
                last, since = seen[r]
                if value != last:
                    seen[r] = (value, now)
            quiet = [r for r, (_, since) in seen.items() if now - since > self.deadline]
            if quiet:
                self._abort(quiet, "stopped sending heartbeats")
            self._past_deadline(now)

    def _past_deadline(self, now: float) -> None:
        """The phase this rank is in has a deadline of its own (:func:`phase`) and has
        outlasted it: the message, ``STALLED``, exit, as for a stall."""
        current = _state.get("deadline")
        if current is None or now - current[1] <= current[2]:
            return
        name, started, deadline_s, setting, waits_on = current
        side, ranks = waits_on or ("the other ranks", [])
        quiet = set(self.quiet(2 * self.interval))
        state = ("stopped sending heartbeats" if ranks and set(ranks) <= quiet else
                 "still sends heartbeats: it is stuck, or slower than the deadline allows")
        message = (f"[megarlhf] error: rank {_who([self.rank])} spent {now - started:.0f} s in "
                   f"phase '{name}', past its deadline of {deadline_s:g} s ({setting}), "
                   f"waiting on {side}" + (f" - rank(s) {_who(ranks)} -" if ranks else "")
                   + f" which {state}. " + _RESUME)
        print(message, file=sys.stderr, flush=True)
        _leave_marker(message)
        os._exit(EXIT_CODE)

    def _get(self, key: str):
        return self.store.get(key) if self.store.check([key]) else None

    def quiet(self, seconds: float) -> list[int]:
        """The ranks whose heartbeat has not moved for ``seconds``."""
        now = time.monotonic()
        return [r for r, (_, since) in dict(self.seen).items() if now - since > seconds]

    def _abort(self, ranks: list[int], why: str) -> None:
        message = _message(self.rank, self.deadline, current_phase(), ranks, why)
        print(message, file=sys.stderr, flush=True)
        _leave_marker(message)
        os._exit(EXIT_CODE)


_RESUME = ("Exiting; the last checkpoint is intact - run the same command again to resume "
           "from it (under slurm/launch.sh the job requeues).")


def name_ranks(names: dict[int, str]) -> None:
    """What some job ranks are, for the messages ('rollout rank 0': parallel.placement)."""
    _state["names"] = dict(names)


def _who(ranks: list[int]) -> str:
    """'1 (host node2), 3 (host node2)': ranks with the hosts they reported (and what they
    are, when :func:`name_ranks` said: '1 (rollout rank 0, host node2)')."""
    hosts = _watch.hosts if _watch is not None else {}
    names = _state.get("names") or {}
    out = []
    for r in ranks:
        about = [names[r]] if r in names else []
        about += [f"host {hosts[r]}"] if r in hosts else []
        out.append(f"{r} ({', '.join(about)})" if about else str(r))
    return ", ".join(out)


def _message(rank: int, deadline: float, where: str, ranks: list[int], why: str) -> str:
    return (f"[megarlhf] error: rank {_who([rank])} waited {deadline / 60:g} minute(s) "
            f"(parallel.timeout_minutes) during phase '{where}': rank(s) {_who(ranks)} {why}. "
            + _RESUME)


def _leave_marker(message: str) -> None:
    """``RUN_DIR/STALLED`` with the message, for slurm/launch.sh."""
    run_dir = _state["run_dir"]
    if run_dir:
        try:
            tmp = os.path.join(run_dir, f"{MARKER}.{os.getpid()}.tmp")
            with open(tmp, "w") as f:
                f.write(message + "\n")
            os.replace(tmp, os.path.join(run_dir, MARKER))
        except OSError:
            pass


def explain(err: BaseException) -> str | None:
    """A collective that timed out (the process groups' own timeout, which may fire just
    before the watchdog): the watchdog's message - the phase the error left and the ranks
    whose heartbeat stopped - with ``STALLED`` left as the watchdog leaves it; None for
    any other error."""
    text = str(err)
    if _watch is None or not isinstance(err, RuntimeError):
        return None
    where = _state.get("failed_in", current_phase())
    first = text.splitlines()[0][:200] if text else type(err).__name__
    if any(s in text for s in _CONNECTION_LOST):
        return _explain_lost(where, first)
    # gloo's "Timed out waiting ...", NCCL's "collective operation timeout" - not any error
    # that merely mentions a timeout (a setting's name, say)
    if not any(s in text for s in ("Timed out", "timed out", "collective operation timeout")):
        return None
    quiet = _watch.quiet(2 * _watch.interval)
    if quiet:
        message = _message(_watch.rank, _watch.deadline, where, quiet,
                           "stopped sending heartbeats") + f" ({first})"
    else:
        message = (f"[megarlhf] error: rank {_who([_watch.rank])}: a collective of phase '{where}' "
                   f"timed out after {_watch.deadline / 60:g} minute(s) "
                   f"(parallel.timeout_minutes) while every rank still sent heartbeats: a "
                   f"rank is slower than the timeout allows, or stuck in a collective "
                   f"({first}). The last checkpoint is intact.")
    _leave_marker(message)
    return message


# A peer's process died or its host went away mid-collective: gloo's and NCCL's words.
_CONNECTION_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                    "remote process exited", "NCCL communicator was aborted")


def _explain_lost(where: str, first: str) -> str:
    """A collective failed because a peer's connection closed (killed, crashed, its node
    lost): the rank(s) whose heartbeat stopped - a dead process stops beating at once, so
    waiting a few heartbeat intervals names it - with ``STALLED`` left for the launcher."""
    waited = time.monotonic()
    quiet = _watch.quiet(2 * _watch.interval)
    while not quiet and time.monotonic() - waited < 4 * _watch.interval:
        time.sleep(_watch.interval / 4)
        quiet = _watch.quiet(2 * _watch.interval)
    who = (f"rank(s) {_who(quiet)}, whose heartbeat stopped," if quiet else
           "a rank whose heartbeat still moves (its process group connection alone broke)")
    message = (f"[megarlhf] error: rank {_who([_watch.rank])} lost its connection to {who} during "
               f"phase '{where}' ({first}): that process died or its node went away. "
               + _RESUME)
    _leave_marker(message)
    return message


def group_timeout() -> datetime.timedelta:
    """``parallel.timeout_minutes`` of this job, for every process group a role builds
    (torch gives a new group a default of its own, not the default group's)."""
    return _state["timeout"]


def start(rank: int, world: int, master_addr: str, master_port: int,
          timeout_minutes: float) -> None:
    """Start this rank's watchdog (nothing for one process). Its own connection to the
    rendezvous store, with a short timeout, so a silent store is noticed too."""
    global _watch
    _state["timeout"] = datetime.timedelta(minutes=timeout_minutes)
    if world <= 1 or _watch is not None:
        return
    import torch.distributed as dist

    deadline = timeout_minutes * 60.0
    interval = max(0.5, min(5.0, deadline / 6))
    store = dist.TCPStore(master_addr, master_port, is_master=False,
                          timeout=datetime.timedelta(seconds=max(2.0, interval)),
                          wait_for_workers=False)
    _watch = _Watch(store, rank, world, deadline, interval)
    _watch.thread.start()
    # Stopped at exit too, whoever ends the process: a daemon thread still inside the
    # store client's C++ call when the interpreter finalizes ends the process with
    # "terminate called without an active exception" (seen in 4-process test workers that
    # only destroyed their process group)
    atexit.unregister(stop)
    atexit.register(stop)


def stop() -> None:
    """Stop the watchdog (the process group is going away)."""
    global _watch
    _state.pop("names", None)
    if _watch is not None:
        _watch.stop.set()
        _watch.thread.join(timeout=10)
        _watch = None
