"""How weights learn: ``optimizer`` (every trained role) and ``train`` (the supervised
loops of sft and rm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    optimizer: Literal["adam", "adamw"] = "adamw"
    """Adam with L2 or decoupled weight decay."""
    lr: float = 1e-5
    """Peak learning rate (the actor's in PPO)."""
    min_lr: float = 0.0
    """Floor of the decay schedules."""
    critic_lr: float = 5e-6
    """Peak learning rate of the critic in PPO (Qwen: 5e-6 with actor 1e-6)."""
    weight_decay: float = 0.0
    """Weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-5
    """Adam epsilon (PyTorch form: applied after bias correction)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    use_distributed_optimizer: bool | Literal["auto"] = "auto"
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer).
    ``auto``: per role, sharded where the role has more than one data-parallel rank, plain
    at DP=1, where sharding saves nothing and costs whole-buffer copies every step (1.3-2x
    slower PPO iterations on CPU, BENCHMARKS.md). Both write the same checkpoint format, so
    a run resumes at any DP whichever optimizer saved it."""
    max_consecutive_skipped_steps: int = 10
    """Stop the run (exit 2) after this many optimizer steps in a row were skipped for
    non-finite gradients - a learning rate far too high, NaN rewards or data; 0 never
    stops. fp16's loss-scale search skips a few steps at the start."""
    max_skipped_fraction: float = 0.25
    """Stop the run (exit 2) when more than this fraction of its optimizer steps were
    skipped: checked once there are 20 steps, and at the end of every run however short
    (fp16 runs: once there are 20 only, its loss-scale search skips the first steps); 1
    never stops."""

    def __post_init__(self):
        for name in ("lr", "critic_lr"):
            require(getattr(self, name) > 0, f"optimizer.{name}", getattr(self, name),
                    "must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            require(0 <= getattr(self, name) < 1, f"optimizer.{name}", getattr(self, name),
                    "must be in [0, 1)")
        require(self.adam_eps > 0, "optimizer.adam_eps", self.adam_eps, "must be > 0")
        require(self.clip_grad >= 0, "optimizer.clip_grad", self.clip_grad, "must be >= 0")
        require(self.weight_decay >= 0, "optimizer.weight_decay", self.weight_decay,
                "must be >= 0")
        require(self.warmup_steps >= 0, "optimizer.warmup_steps", self.warmup_steps,
                "must be >= 0")
        require(self.max_consecutive_skipped_steps >= 0, "optimizer.max_consecutive_skipped_steps",
                self.max_consecutive_skipped_steps, "must be >= 0 (0: never stop)")
        require(0 < self.max_skipped_fraction <= 1, "optimizer.max_skipped_fraction",
                self.max_skipped_fraction, "must be in (0, 1] (1: never stop)")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    global_batch_size: int = 32
    """Samples per optimizer step, all data-parallel ranks (SFT: sequences; RM: pairs)."""
    micro_batch_size: int = 4
    """Samples per forward/backward pass on one data-parallel rank when padded; packed (the
    default), with data.max_seq_len it sizes the token budget (max_tokens_per_micro_batch)."""
    max_tokens_per_micro_batch: int | Literal["auto"] | None = "auto"
    """Pack micro-batches (``sft``, ``rm``, ``dpo``, ``distill``): each holds whole
    samples (a preference pair: both sequences) of at most this many tokens back to back,
    attention kept within each sequence, and each data-parallel rank's share of a global
    batch carries a balanced token count. It bounds a pass's activation memory the way
    micro_batch_size x the longest sample does when padded. auto: micro_batch_size x the
    longest sample (data.max_seq_len; a pair: twice that), and padded micro-batches under
    data.packing, which packs rows of its own. null: padded micro-batches of
    micro_batch_size samples."""
    num_epochs: int = 1
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    eval_interval: int = 0
    """Evaluate every N steps; 0 evaluates only at the end."""
    rm_normalize_path: str | None = None
    """RM stage: SFT-format data (prompt, response) whose scores are normalised to mean 0,
    std 1 after training; None uses the training pairs' chosen and rejected responses."""

    def __post_init__(self):
        for name in ("global_batch_size", "micro_batch_size", "num_epochs"):
            require(getattr(self, name) >= 1, f"train.{name}", getattr(self, name),
                     "must be >= 1")
        if self.max_tokens_per_micro_batch not in (None, "auto"):
            require(self.max_tokens_per_micro_batch >= 1, "train.max_tokens_per_micro_batch",
                    self.max_tokens_per_micro_batch, "must be >= 1, or null for padded "
                    "micro-batches of train.micro_batch_size samples")
        if self.max_steps is not None:
            require(self.max_steps >= 1, "train.max_steps", self.max_steps,
                     "must be >= 1 or null")
        require(self.eval_interval >= 0, "train.eval_interval", self.eval_interval,
                "must be >= 0")
