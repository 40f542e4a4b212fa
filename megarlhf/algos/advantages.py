"""Advantage estimators: GAE with a critic, and critic-free group/global baselines."""

from __future__ import annotations

import torch

from megarlhf.algos.masked import masked_whiten


def gae(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over left-aligned, variable-length responses.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  R = A + V.
    Rewards and values after each response's end are zeroed first, so the value after the
    last token is 0 (terminal) and nothing leaks across the end. A gap in the mask (the
    tokens an environment wrote between two of the model's turns) is skipped: the next
    value and the running advantage pass through it unchanged, so GAE runs over the
    model's tokens as one sequence (what verl does for multi-turn rollouts). Returns
    (advantages_BT, returns_BT), both zero outside the mask.
    """
    mask = mask_BT.to(rewards_BT.dtype)
    rewards, values = rewards_BT * mask, values_BT * mask
    T = rewards.shape[-1]
    last_gae = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(last_gae)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = mask[:, t]
        last_gae = torch.where(here > 0, delta + gamma * lam * last_gae, last_gae)
        next_value = torch.where(here > 0, values[:, t], next_value)
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor,
                       gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma G_{t+1}, zero after each response's end; a gap in the mask (an
    environment's tokens) is skipped, as :func:`gae` skips it."""
    mask = mask_BT.to(rewards_BT.dtype)
    rewards = rewards_BT * mask
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def _groups(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or scores_B.shape[0] % group_size != 0:
        raise ValueError(f"batch of {scores_B.shape[0]} samples is not divisible by the group "
                         f"size {group_size} (ppo.group_size)")
    return scores_B.view(-1, group_size)


def grpo_advantages(scores_B: torch.Tensor, group_size: int, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath): (score - group mean) / (group std + eps), per sample. Samples of
    one prompt are consecutive. std is unbiased (torch's default, as TRL's GRPOTrainer)."""
    groups = _groups(scores_B, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def grpo_token_advantages(scores_B: torch.Tensor, mask_BT: torch.Tensor, group_size: int,
                          scale_by_std: bool = True, eps: float = 1e-5) -> torch.Tensor:
    """GRPO normalised at the token level (AReaL): every response token carries its
    sample's score, and the mean and (population) std are taken over all valid tokens of
    the group, so a long response weighs more in its group's statistics than a short one.
    Returns (B, T) advantages, zero outside the mask."""
    groups = _groups(scores_B, group_size)  # (G, k)
    mask = mask_BT.to(scores_B.dtype).view(groups.shape[0], group_size, -1)  # (G, k, T)
    tokens = mask.sum(dim=(1, 2)).clamp(min=1)  # (G,)
    per_token = groups.unsqueeze(-1) * mask
    mean = per_token.sum(dim=(1, 2)) / tokens
    centred = (groups.unsqueeze(-1) - mean.view(-1, 1, 1)) * mask
    if scale_by_std:
        std = (centred.square().sum(dim=(1, 2)) / tokens).sqrt()
        centred = centred / (std.view(-1, 1, 1) + eps)
    return centred.reshape(mask_BT.shape)


def rloo_advantages(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): score minus the mean of the other k-1 samples."""
    if group_size < 2:
        raise ValueError("RLOO needs ppo.group_size >= 2")
    groups = _groups(scores_B, group_size)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).reshape(-1)


def reinforce_pp_advantages(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0,
                            unbiased: bool = True) -> torch.Tensor:
    """REINFORCE++ (OpenRLHF): discounted returns of the KL-shaped token rewards, whitened
    over the whole (global) batch. Zero outside the mask."""
    returns = discounted_returns(rewards_BT, mask_BT, gamma)
    return masked_whiten(returns, mask_BT, unbiased=unbiased) * mask_BT


def broadcast_to_tokens(advantages_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A per-sample advantage on every response token."""
    return advantages_B.unsqueeze(-1) * mask_BT.to(advantages_B.dtype)


def estimate_advantages(estimator: str, *, scores_B: torch.Tensor, rewards_BT: torch.Tensor,
                        values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
                        lam: float, group_size: int, whiten: bool, unbiased: bool = True,
                        group_norm: str = "sequence") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BT, returns_BT) for ``ppo.advantage_estimator``:

    - ``gae``: GAE on the KL-shaped rewards with the critic's values (returns = A + V);
    - ``reinforce_pp``: whitened discounted returns of the shaped rewards (no critic);
    - ``grpo`` / ``rloo``: a group baseline on the sequence score, on every token (samples
      of one prompt are consecutive). GRPO's ``group_norm``: ``sequence`` (score minus the
      group mean over the unbiased group std: DeepSeekMath as TRL computes it), ``token``
      (mean and std over the group's valid tokens: AReaL), ``center`` (mean only: Dr. GRPO).
    ``whiten`` whitens GAE and RLOO advantages over the batch (GRPO is normalised within
    its groups, REINFORCE++ always whitened). Critic-free estimators return their
    advantages before batch whitening as the returns (nothing trains on them)."""
    mask = mask_BT.to(rewards_BT.dtype)
    if estimator == "gae":
        advantages, returns = gae(rewards_BT, values_BT, mask, gamma, lam)
    elif estimator == "reinforce_pp":
        advantages = reinforce_pp_advantages(rewards_BT, mask, gamma, unbiased)
        returns = advantages.clone()
    elif estimator == "grpo" and group_norm == "token":
        advantages = grpo_token_advantages(scores_B, mask, group_size)
        returns = advantages.clone()
    elif estimator == "grpo":
        if group_norm not in ("sequence", "center"):
            raise ValueError(f"GRPO normalisation must be sequence, token or center, "
                             f"got {group_norm!r}")
        per_sample = grpo_advantages(scores_B, group_size, scale_by_std=group_norm == "sequence")
        advantages = broadcast_to_tokens(per_sample, mask)
        returns = advantages.clone()
    elif estimator == "rloo":
        advantages = broadcast_to_tokens(rloo_advantages(scores_B, group_size), mask)
        returns = advantages.clone()
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if whiten and estimator in ("gae", "rloo"):
        advantages = masked_whiten(advantages, mask, unbiased=unbiased) * mask
    return advantages, returns
