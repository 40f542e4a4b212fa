"""Signal handlers that turn SIGUSR1 / SIGTERM / SIGINT into a request to checkpoint at the
next safe point. No torch import here: the CLI installs them before anything slow."""

from __future__ import annotations

import signal
import sys
import threading

from megarlhf.parallel.rank import is_first

_STATE = {"asked": False, "installed": False, "interrupts": 0}
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def install_handlers() -> None:
    """Catch SIGUSR1 / SIGTERM / SIGINT from now on (the CLI calls this first, before the
    imports and model builds that can take minutes): the run checkpoints at its next safe
    point. A second Ctrl-C aborts at once."""
    if _STATE["installed"] or threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    _STATE["installed"] = True
    die_with_parent()


_FORKER = [0]


def die_with_parent() -> None:
    """Processes this one forks from now on (megatron's checkpoint writers) are killed when
    it dies: without that, a run killed during a save leaves its writers waiting forever
    for a parent that is gone (Linux's PR_SET_PDEATHSIG, set in each forked child; a child
    whose parent died before that is set exits at once)."""
    if _STATE.get("forks_die") or not sys.platform.startswith("linux"):
        return
    import ctypes
    import os

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return

    def before() -> None:
        _FORKER[0] = os.getpid()

    def in_child() -> None:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != _FORKER[0]:
            os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)
    _STATE["forks_die"] = True


def _handler(signum, frame):
    if signum == signal.SIGINT:
        _STATE["interrupts"] += 1
        if _STATE["interrupts"] > 1:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if is_first():  # every rank of a terminal's job gets the Ctrl-C
            print("\n[signal] Ctrl-C: checkpointing at the next safe point (Ctrl-C again "
                  "aborts without a checkpoint)", flush=True)
    _STATE["asked"] = True


def asked() -> bool:
    """Whether this process was signalled since the handlers were installed."""
    return _STATE["asked"]
