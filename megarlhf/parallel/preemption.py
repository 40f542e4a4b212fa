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

    def requested(self) -> bool:
        """Collective: True on every rank when any rank received the signal."""
        flag = torch.tensor([1.0 if signals.asked() else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def mark_preempted(run_dir: str, checkpoint: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp = os.path.join(run_dir, MARKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(checkpoint)
        os.replace(tmp, os.path.join(run_dir, MARKER))
        print(f"[preempt] checkpoint {checkpoint} written; exiting for requeue", flush=True)
