"""Preemption: SIGUSR1 / SIGTERM / Ctrl-C ask the job to checkpoint at the next safe point.

Slurm sends the signal (``#SBATCH --signal=B:USR1@120``, ``scancel --signal=USR1``) to the
tasks at slightly different times; ranks agree through an all-reduce at each safe point,
so all of them save the same step. Rank 0 then leaves ``RUN_DIR/PREEMPTED`` (naming the
checkpoint) for ``slurm/launch.sh``, which requeues the job.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarlhf.parallel import signals
from megarlhf.parallel.signals import install_handlers

MARKER = "PREEMPTED"


class PreemptionGuard:
    """Asks, at each safe point, whether any rank was signalled since start-up."""

    def __init__(self):
        install_handlers()
        self.signalled: list[int] = []  # the ranks that had received it, once requested

    def requested(self) -> bool:
        """Collective: True on every rank when any rank received the signal (which ranks
        did is kept in ``signalled``, for the message: under Slurm, every task should)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        flags = torch.zeros(world)
        flags[dist.get_rank() if dist.is_initialized() else 0] = 1.0 if signals.asked() else 0.0
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self.signalled = [r for r in range(world) if flags[r] > 0]
        return bool(self.signalled)


def mark_preempted(run_dir: str, checkpoint: str, signalled: list[int] | None = None) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = os.path.join(run_dir, MARKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(checkpoint)
        os.replace(tmp, os.path.join(run_dir, MARKER))
        world = dist.get_world_size() if dist.is_initialized() else 1
        seen = "" if signalled is None else (
            f" (the signal reached {len(signalled)} of {world} ranks: "
            f"{', '.join(map(str, signalled))})")
        print(f"[preempt] checkpoint {checkpoint} written{seen}; exiting for requeue",
              flush=True)
