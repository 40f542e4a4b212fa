"""Signal handlers that turn SIGUSR1 / SIGTERM / SIGINT into a request to checkpoint at the
next safe point. No torch import here: the CLI installs them before anything slow."""

from __future__ import annotations

import signal
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
