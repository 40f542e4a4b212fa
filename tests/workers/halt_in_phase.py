"""A rank that halts in a chosen phase of a real run through the CLI, for the watchdog
tests. argv: PHASE SIGNAL, then the CLI's arguments. Rank 1 sends itself SIGNAL (STOP:
wedged, as a lost node looks to the others; KILL: gone without a trace) when it enters
the first phase whose label starts with PHASE after its first checkpoint was saved (so a
resume has something to start from; for ``checkpoint save`` itself: the second save)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from megarlhf import cli
from megarlhf.parallel import watchdog

PHASE, SIGNAL = sys.argv[1], getattr(signal, f"SIG{sys.argv[2]}")
SAVED = [False]
natural_phase = watchdog.phase


@contextlib.contextmanager
def phase(name: str, **kwargs):
    if SAVED[0] and name.startswith(PHASE) and os.environ.get("RANK") == "1":
        print(f"[halt_in_phase] rank 1 sends itself SIG{sys.argv[2]} in phase '{name}'",
              flush=True)
        os.kill(os.getpid(), SIGNAL)
    with natural_phase(name, **kwargs):
        yield
    if name == "checkpoint save":
        SAVED[0] = True


watchdog.phase = phase

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[3:]))
