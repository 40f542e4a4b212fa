"""Run identity, checkpoints and logging: ``run``, ``checkpoint``, ``logging``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    name: str = "megarlhf"
    """Run name; outputs go to ``{output_dir}/{name}``."""
    output_dir: str = "runs"
    """Parent folder of run directories (metrics, checkpoints, plots)."""
    seed: int = 1234
    """Seed for model initialisation, data order and sampling."""
    deterministic: bool = False
    """Use deterministic algorithms (bitwise-reproducible resumes on CPU)."""
    num_threads: int = 0
    """torch intra-op threads per process; 0 leaves torch's default."""
    allow_nonfinite: list[str] = field(default_factory=list)
    """Metrics that may be NaN or infinite without stopping the run: names of metrics.jsonl
    or shell patterns (``eval/*``). Any other non-finite metric, in any phase - an update,
    an evaluation, the rollout's scores, a reward model's normalisation - stops the run
    (exit 2) naming it, before that step is saved. An update whose optimizer steps were
    skipped for non-finite gradients is left to optimizer.max_consecutive_skipped_steps
    and optimizer.max_skipped_fraction: its losses are not checked here."""
    metric_bands: dict[str, list[float | None]] = field(default_factory=dict)
    """Stop the run (exit 2) when a logged metric leaves its band [low, high] (null: no
    bound on that side), before that step is saved, however short the run: e.g.
    ``{"objective/kl": [null, 20], "objective/entropy": [0.05, null], "train/loss":
    [null, 10]}``. A non-finite value is outside every band. Names are those of
    metrics.jsonl; one that never appears is reported at the end of the run."""

    def __post_init__(self):
        require(bool(self.name) and "/" not in self.name, "run.name", self.name,
                "a non-empty name without '/'")
        require(self.num_threads >= 0, "run.num_threads", self.num_threads, "must be >= 0")
        for pattern in self.allow_nonfinite:
            require(isinstance(pattern, str) and bool(pattern), "run.allow_nonfinite",
                    self.allow_nonfinite, "must list metric names or patterns (strings)")
        for name, band in self.metric_bands.items():
            require(len(band) == 2, f"run.metric_bands.{name}", band,
                    "must be [low, high] (null for no bound on that side)")
            require(band != [None, None], f"run.metric_bands.{name}", band,
                    "bounds nothing: give low, high or both")
            require(all(b is None or math.isfinite(b) for b in band),
                    f"run.metric_bands.{name}", band, "bounds must be finite numbers or null")
            if None not in band:
                require(band[0] < band[1], f"run.metric_bands.{name}", band,
                        "low must be below high")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    load: str | None = None
    """Checkpoint to initialise weights from (a run's checkpoint folder or one step)."""
    resume: bool = True
    """Continue from the run's own latest checkpoint (weights, optimizer, data position,
    RNG) when one exists."""
    save_interval: int = 0
    """Save every N steps; 0 saves only at the end."""
    keep_last: int = 2
    """How many checkpoints to keep."""
    adapters_only: bool = True
    """A role with LoRA adapters (``model.lora``) whose base came from a checkpoint saves
    only what trains - its adapters, a value model's head - and names that base checkpoint
    (with a digest of its metadata), which loading reads first: a checkpoint of megabytes
    instead of the model. false saves whole models (a checkpoint that outlives its base)."""
    checksums: bool = True
    """Record the size and SHA-256 of every file a checkpoint writes (model and optimizer
    shards, the format's own index files, the objects saved beside them) and of every
    shard of a frozen-model cache, and of the run's metrics.jsonl as of the save, and check
    them when read: a changed, truncated or missing file is named, and a resume falls back
    to the newest checkpoint that holds what its save wrote (a cache is rebuilt). Costs a read of every file at save and at
    load (docs/checkpoints-and-config.md has the measured seconds per GB); false for huge
    checkpoints on slow storage."""

    def __post_init__(self):
        require(self.save_interval >= 0, "checkpoint.save_interval", self.save_interval,
                "must be >= 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, "must be >= 1")


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    log_interval: int = 1
    """Write metrics every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    wandb_project: str | None = None
    """Log to Weights & Biases under this project when wandb is installed."""
    sample_table_interval: int = 10
    """Print a table of sample prompts and responses every N iterations."""
    progress_bar: bool = True
    """Show progress on rank 0: a bar on a terminal; when stderr is a file (a Slurm log), a
    plain line every 10 seconds and at the end."""
    memory_metrics: bool = True
    """PPO: per-phase memory accounting of every role (memory/* metrics in MiB and a table
    at the end of the run); false skips the bookkeeping."""

    def __post_init__(self):
        require(self.log_interval >= 1, "logging.log_interval", self.log_interval,
                "must be >= 1")
        require(self.sample_table_interval >= 0, "logging.sample_table_interval",
                self.sample_table_interval, "must be >= 0 (0: no sample tables)")
