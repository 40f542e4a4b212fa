"""From a scored rollout to what PPO learns from: the per-token KL to the reference, the
shaped rewards and the advantages and returns of the chosen estimator."""

from __future__ import annotations

import torch

from megarlhf.algos.advantages import estimate_advantages
from megarlhf.algos.kl import kl_per_token
from megarlhf.algos.masked import masked_whiten
from megarlhf.algos.rewards import shape_rewards


def learning_targets(*, logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor,
                     values_BT: torch.Tensor, scores_B: torch.Tensor, mask_BT: torch.Tensor,
                     kl_estimator: str, kl_coef: float, clip_reward_value: float | None,
                     whiten_rewards: bool, whiten_unbiased: bool, estimator: str,
                     gamma: float, lam: float, group_size: int, whiten_advantages: bool,
                     group_norm: str, turn_rewards_BT: torch.Tensor | None = None,
                     teacher_logprobs_BT: torch.Tensor | None = None,
                     teacher_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """``kl_BT``, ``rewards_BT``, ``advantages_BT``, ``returns_BT`` of one batch.

    The KL of the policy that sampled (``logprobs_BT``, the old log-probs) to the
    reference, per token; rewards -``kl_coef`` x KL per token plus the (clipped) score at
    the last token (``kl_coef`` 0: the KL is not in the reward), optionally whitened
    without shifting the mean; the sequence reward (score - kl_coef x summed KL) for the
    group baselines; then :func:`estimate_advantages`.

    ``turn_rewards_BT`` (multi-turn rollouts, ``rollout.environment.name``): the rewards of the
    turns before the last, each at its turn's last token. They join the per-token rewards
    (GAE, REINFORCE++) where they fell, and the sequence reward (GRPO, RLOO) as a sum;
    ``scores_B`` is the last turn's reward.

    ``teacher_logprobs_BT`` (on-policy distillation, ``ppo.teacher``): the reverse KL to the
    teacher per token, k1 = logprobs - teacher's (``teacher_kl_BT``); ``teacher_coef`` x it
    comes off the per-token rewards and, summed, off the sequence reward, as the
    reference's KL does (0: reported only - the loss takes it)."""
    mask = mask_BT
    kl = kl_per_token(logprobs_BT, ref_logprobs_BT, mask, kl_estimator)
    rewards, _ = shape_rewards(scores_B, kl, mask, kl_coef, clip_reward_value)
    sequence_rewards = scores_B - kl_coef * kl.sum(dim=1)
    if turn_rewards_BT is not None:
        turns = turn_rewards_BT.to(rewards.dtype) * mask
        rewards = rewards + turns
        sequence_rewards = sequence_rewards + turns.sum(dim=1)
    teacher_kl = None
    if teacher_logprobs_BT is not None:
        teacher_kl = kl_per_token(logprobs_BT, teacher_logprobs_BT, mask, "k1")
        rewards = rewards - teacher_coef * teacher_kl
        sequence_rewards = sequence_rewards - teacher_coef * teacher_kl.sum(dim=1)
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False, unbiased=whiten_unbiased) * mask
    advantages, returns = estimate_advantages(
        estimator, scores_B=sequence_rewards, rewards_BT=rewards, values_BT=values_BT,
        mask_BT=mask, gamma=gamma, lam=lam, group_size=group_size, whiten=whiten_advantages,
        unbiased=whiten_unbiased, group_norm=group_norm)
    return {"kl_BT": kl, "rewards_BT": rewards, "advantages_BT": advantages,
            "returns_BT": returns, "teacher_kl_BT": teacher_kl}
