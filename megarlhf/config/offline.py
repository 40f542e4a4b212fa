"""The offline stages: ``dpo``, ``distill`` and the frozen-model ``cache`` they read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarlhf.config.fields import require


@dataclass(kw_only=True, frozen=True)
class DPOConfig:
    """Direct preference optimisation (``megarlhf dpo``): the policy learns from chosen /
    rejected pairs against a frozen reference, whose log-probs come from the cache."""

    beta: float = 0.1
    """Strength of the implicit KL to the reference (the reward scale beta)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * margin); ipo: (margin - 1 / (2 beta))^2."""
    label_smoothing: float = 0.0
    """cDPO: the fraction of pairs assumed mislabelled (sigmoid loss only), in [0, 0.5)."""
    use_cache: bool = True
    """Reference log-probs from the cache (built once, the reference not resident while the
    policy learns); false: the reference stays built and scores every global batch."""
    gold_reward_fn: str | None = None
    """``module:function(prompt, response) -> float`` scoring greedy samples of the policy
    on ``gold_eval_path``'s prompts at every evaluation (eval/gold_score); None: off."""
    gold_eval_path: str | None = None
    """Prompt rows for the gold evaluation (rollout.* sets the sampling)."""
    num_gold_prompts: int = 64
    """How many of those prompts."""

    def __post_init__(self):
        require(self.beta > 0, "dpo.beta", self.beta, "must be > 0")
        require(0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing",
                self.label_smoothing, "must be in [0, 0.5)")
        require(self.num_gold_prompts >= 1, "dpo.num_gold_prompts", self.num_gold_prompts,
                "must be >= 1")


@dataclass(kw_only=True, frozen=True)
class DistillConfig:
    """Knowledge distillation (``megarlhf distill``): a student learns the teacher's next-
    token distribution on the response tokens of SFT-format rows, from the teacher's
    cached top-k log-probs."""

    top_k: int = 16
    """Teacher log-probs kept per position; the rest of its mass is one remaining bucket."""
    divergence: Literal["forward", "reverse"] = "forward"
    """forward: KL(teacher || student) over the top-k plus the remaining mass (mode
    covering); reverse: KL(student || teacher) on the same k + 1 buckets (mode seeking)."""
    temperature: float = 1.0
    """Softmax temperature of teacher and student."""
    nll_coef: float = 0.0
    """Weight of the ordinary next-token loss on the data's responses, added to the KL."""

    def __post_init__(self):
        require(self.top_k >= 1, "distill.top_k", self.top_k, "must be >= 1")
        require(self.temperature > 0, "distill.temperature", self.temperature, "must be > 0")
        require(self.nll_coef >= 0, "distill.nll_coef", self.nll_coef, "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class CacheConfig:
    """The frozen-model cache (reference log-probs for DPO, teacher top-k for distill)."""

    path: str | None = None
    """Folder of the cache; None: {run.output_dir}/{run.name}/cache/<role>."""
    on_stale: Literal["rebuild", "error"] = "rebuild"
    """A cache built from another checkpoint, data, temperature or top-k: rebuild it, or
    stop with what differs."""
    micro_batch_size: int = 8
    """Rows per forward micro-batch while building."""
    max_tokens_per_micro_batch: int | None = None
    """Pack the build's micro-batches instead: whole rows, at most this many tokens, each
    data-parallel replica a share of balanced token count (data.packing). None:
    train.max_tokens_per_micro_batch's value - when it is auto, micro_batch_size rows of
    data.max_seq_len, and when it is null, padded micro-batches of micro_batch_size rows.
    The cache holds the same numbers either way (to fp32 rounding)."""

    def __post_init__(self):
        require(self.micro_batch_size >= 1, "cache.micro_batch_size", self.micro_batch_size,
                "must be >= 1")
        if self.max_tokens_per_micro_batch is not None:
            require(self.max_tokens_per_micro_batch >= 1, "cache.max_tokens_per_micro_batch",
                    self.max_tokens_per_micro_batch, "must be >= 1, or null")
