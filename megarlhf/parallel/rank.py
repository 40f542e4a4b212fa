"""This process's rank as its launcher set it, before any process group exists: for
printing a start-up line once per job. No torch import (the CLI asks before anything slow)."""

from __future__ import annotations

import os


def launcher_rank(environ: dict | None = None) -> int:
    """torchrun's ``RANK``, else srun's ``SLURM_PROCID`` (with ``SLURM_NTASKS``), else 0:
    the same precedence as ``parallel.launch.read_dist_env``."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"])
    return 0


def is_first() -> bool:
    """Rank 0 of the job: of the process group when one exists, else the launcher's."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return launcher_rank() == 0


def print0(*args) -> None:
    """Print on the job's first rank only (also before the process group exists)."""
    if is_first():
        print(*args, flush=True)
