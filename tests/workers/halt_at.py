"""A CLI run (one process, or each process of a torchrun job) that halts itself the
COUNT-th time it enters a phase whose label starts with PHASE: SIGNAL KILL (gone without a
trace, as a lost machine) or STOP (wedged), or HANG (its main thread sleeps: the process
is stuck, its heartbeats go on - until a peer declares the job stalled, leaving STALLED in
the run directory, when it leaves as torchrun would have made it, sooner). argv: PHASE COUNT SIGNAL, then the CLI's
arguments. Deterministic where a signal from outside, timed against the files a run
writes, lands wherever the run has got to. In a split job only one side enters most
phases (``update of the actor``: training; ``generation``: rollout)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from megarlhf import cli
from megarlhf.parallel import watchdog

PHASE, COUNT = sys.argv[1], int(sys.argv[2])
SIGNAL = None if sys.argv[3] == "HANG" else getattr(signal, f"SIG{sys.argv[3]}")
entered = [0]
natural_phase = watchdog.phase


@contextlib.contextmanager
def phase(name: str, **kwargs):
    if name.startswith(PHASE):
        entered[0] += 1
        if entered[0] == COUNT:
            print(f"[halt_at] job rank {os.environ.get('RANK', '0')} sends itself "
                  f"SIG{sys.argv[3]} in phase '{name}'", flush=True)
            if SIGNAL is None:
                marker = os.path.join(watchdog._state["run_dir"], watchdog.MARKER)
                until = time.monotonic() + 600
                while not os.path.exists(marker) and time.monotonic() < until:
                    time.sleep(0.2)
                print(f"[halt_at] job rank {os.environ.get('RANK', '0')}: the job was "
                      "declared stalled; leaving", flush=True)
                os._exit(1)
            os.kill(os.getpid(), SIGNAL)
    with natural_phase(name, **kwargs):
        yield


watchdog.phase = phase

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[4:]))
