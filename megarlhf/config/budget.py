"""The longest sample a PPO config allows, which packed micro-batches' token budgets must
hold (``config.rules``) and their ``auto`` value is sized by (``data.budgets``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megarlhf.config.tree import Config


def longest_ppo_sample(cfg: Config) -> int:
    """The longest sample a PPO run keeps: ``data.max_prompt_len`` +
    ``rollout.max_new_tokens``, or an episode (an environment's or an agent's), up to ``data.max_seq_len``."""
    if cfg.rollout.episodic:
        return cfg.data.max_seq_len
    return cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
