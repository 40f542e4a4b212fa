"""The token budgets of packed micro-batches, as a run uses them.

Every stage and pass packs its micro-batches by default: whole samples back to back in
one row, each attending to itself only, at most a token budget per forward pass. A
budget left at ``"auto"`` is the micro-batch size times the longest sample the config
allows, so a pass never holds more tokens than the padded micro-batch of the longest
samples would, and shorter samples share a pass instead of padding. ``null`` keeps padded
micro-batches of ``micro_batch_size`` rows; a number is the budget as written.
"""

from __future__ import annotations

from megarlhf.config import Config
from megarlhf.config.budget import longest_ppo_sample

AUTO = "auto"


def update_budget(cfg: Config) -> int | None:
    """Tokens per micro-batch of the PPO updates (``ppo.max_tokens_per_micro_batch``);
    None: padded micro-batches."""
    budget = cfg.ppo.max_tokens_per_micro_batch
    if budget == AUTO:
        return cfg.ppo.micro_batch_size * longest_ppo_sample(cfg)
    return budget


def forward_budget(cfg: Config) -> int | None:
    """Tokens per micro-batch of the experience passes
    (``rollout.forward_max_tokens_per_micro_batch``; unset: the updates' budget as
    written, or, when that is ``auto``, the forward micro-batch size times the longest
    sample); None: padded micro-batches."""
    rollout, ppo = cfg.rollout, cfg.ppo
    if rollout.forward_max_tokens_per_micro_batch is not None:
        return rollout.forward_max_tokens_per_micro_batch
    if ppo.max_tokens_per_micro_batch == AUTO:
        rows = rollout.forward_micro_batch_size or ppo.micro_batch_size
        return rows * longest_ppo_sample(cfg)
    return ppo.max_tokens_per_micro_batch


def train_budget(cfg: Config, sequences: int = 1) -> int | None:
    """Tokens per micro-batch of the supervised stages (``train.max_tokens_per_micro_batch``)
    whose items hold ``sequences`` sequences each (a preference pair: 2); ``auto`` under
    ``data.packing`` (which packs rows of its own): None, padded micro-batches."""
    budget = cfg.train.max_tokens_per_micro_batch
    if budget == AUTO:
        if cfg.data.packing:
            return None
        return cfg.train.micro_batch_size * sequences * cfg.data.max_seq_len
    return budget


def cache_budget(cfg: Config) -> int | None:
    """Tokens per micro-batch while a frozen-model cache is built
    (``cache.max_tokens_per_micro_batch``; unset: the training budget as written, or, when
    that is ``auto``, ``cache.micro_batch_size`` rows of ``data.max_seq_len``)."""
    if cfg.cache.max_tokens_per_micro_batch is not None:
        return cfg.cache.max_tokens_per_micro_batch
    if cfg.train.max_tokens_per_micro_batch == AUTO:
        return None if cfg.data.packing else cfg.cache.micro_batch_size * cfg.data.max_seq_len
    return cfg.train.max_tokens_per_micro_batch
