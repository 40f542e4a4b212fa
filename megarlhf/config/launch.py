"""Slurm resources of ``megarlhf launch``: ``launch``."""

from __future__ import annotations

from dataclasses import dataclass

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class LaunchConfig:
    nodes: int = 1
    """Slurm nodes."""
    tasks_per_node: int = 8
    """Processes per node: one per GPU (on CPU, one per process you want)."""
    gpus_per_node: int = 8
    """GPUs requested per node (0 on CPU-only clusters)."""
    cpus_per_task: int = 8
    """CPU cores per process."""
    time: str = "04:00:00"
    """Wall-time limit (Slurm format)."""
    partition: str | None = None
    """Slurm partition; None uses the cluster default."""
    account: str | None = None
    """Slurm account."""
    preempt_signal_seconds: int = 120
    """Slurm sends SIGUSR1 this long before the time limit; the job checkpoints and
    requeues itself."""
    log_dir: str = "logs"
    """Where job logs go (one file per job)."""
    python: str = "python"
    """Python executable on the compute nodes (e.g. a venv's)."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU in GiB (e.g. 80): ``megarlhf launch`` then refuses a config whose
    predicted per-GPU memory (``megarlhf plan``) does not fit. None: no check."""

    def __post_init__(self):
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            require(getattr(self, name) >= 1, f"launch.{name}", getattr(self, name),
                    "must be >= 1")
        require(self.gpus_per_node >= 0, "launch.gpus_per_node", self.gpus_per_node,
                "must be >= 0")
        require(self.preempt_signal_seconds >= 1, "launch.preempt_signal_seconds",
                self.preempt_signal_seconds, "must be >= 1")
        if self.gpu_memory_gib is not None:
            require(self.gpu_memory_gib > 0, "launch.gpu_memory_gib", self.gpu_memory_gib,
                    "must be > 0 or null")
