"""A CLI run (each process of a split torchrun job) whose rollout process takes the
weights offered in flight (rollout.placement.partial) at decode step STEP of every batch that is
offered some - batch 1 onward: the training side offers each update to the batch being
sampled, and batch 0 is sampled before the first - not before it, and waiting there until
the offer is in.
So the step at which a batch changes weights is fixed, where in a run it depends on
timing. argv: STEP, then the CLI's arguments."""

from __future__ import annotations

import sys
import time

from megarlhf import cli
from megarlhf.rollout import remote

STEP = int(sys.argv[1])
natural_call = remote.InFlight.__call__


def call(self) -> bool:
    self.calls = getattr(self, "calls", 0) + 1
    if int(self.key) >= 1 and self.calls < STEP:
        return False  # not before STEP, however early the offer is in
    if self.calls == STEP and int(self.key) >= 1:
        deadline = time.monotonic() + 120
        while self.offered() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    return natural_call(self)


remote.InFlight.__call__ = call

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
