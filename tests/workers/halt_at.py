"""A CLI run (one process, or each process of a torchrun job) that halts itself the
COUNT-th time it enters a phase whose label starts with PHASE: SIGNAL KILL (gone without a
trace, as a lost machine) or STOP (wedged). argv: PHASE COUNT SIGNAL, then the CLI's
arguments. Deterministic where a signal from outside, timed against the files a run
writes, lands wherever the run has got to. In a split job only one side enters most
phases (``update of the actor``: training; ``generation``: rollout)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from megarlhf import cli
from megarlhf.parallel import watchdog

PHASE, COUNT, SIGNAL = sys.argv[1], int(sys.argv[2]), getattr(signal, f"SIG{sys.argv[3]}")
entered = [0]
natural_phase = watchdog.phase


@contextlib.contextmanager
def phase(name: str):
    if name.startswith(PHASE):
        entered[0] += 1
        if entered[0] == COUNT:
            print(f"[halt_at] job rank {os.environ.get('RANK', '0')} sends itself "
                  f"SIG{sys.argv[3]} in phase '{name}'", flush=True)
            os.kill(os.getpid(), SIGNAL)
    with natural_phase(name):
        yield


watchdog.phase = phase

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[4:]))
