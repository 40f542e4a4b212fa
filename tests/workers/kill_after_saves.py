"""A single-process CLI run that kills itself with SIGKILL - gone without a trace, as a
lost machine - on entering the first phase whose label starts with PHASE after SAVES
checkpoints were saved. argv: SAVES PHASE, then the CLI's arguments. Deterministic where a
kill from outside, timed against the checkpoint files, lands wherever the run has got to."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from megarlhf import cli
from megarlhf.parallel import watchdog

SAVES, PHASE = int(sys.argv[1]), sys.argv[2]
saved = [0]
natural_phase = watchdog.phase


@contextlib.contextmanager
def phase(name: str):
    if saved[0] >= SAVES and name.startswith(PHASE):
        print(f"[kill_after_saves] SIGKILL in phase '{name}'", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    with natural_phase(name):
        yield
    if name == "checkpoint save":
        saved[0] += 1


watchdog.phase = phase

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[3:]))
