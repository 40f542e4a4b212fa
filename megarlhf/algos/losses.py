"""PPO losses and their diagnostics.

Each loss returns ``(total, count, stats)``: the loss is ``total / count``. Returning the
two parts lets the training engine divide by the count summed over micro-batches and
data-parallel ranks (megatron's per-token loss mode), so a token-level mean is exact
however the batch is split. ``aggregate`` turns the parts into a number.

Aggregation modes: ``token_mean`` (every valid token weighs the same), and
``seq_mean_token_mean`` / ``seq_mean_token_sum`` (each sequence weighs the same; its
tokens are averaged or summed).
"""

from __future__ import annotations

import torch

from megarlhf.algos.masked import masked_mean, masked_var

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def aggregate_parts(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str = "token_mean",
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, count) of ``loss_BT`` under ``mode``; the aggregated loss is total / count."""
    mask = mask_BT.to(loss_BT.dtype)
    if mode == "token_mean":
        return (loss_BT * mask).sum(), mask.sum()
    seq_tokens = mask.sum(dim=-1)
    has_tokens = (seq_tokens > 0).to(loss_BT.dtype)
    seq_sum = (loss_BT * mask).sum(dim=-1)
    if mode == "seq_mean_token_mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)
    elif mode == "seq_mean_token_sum":
        per_seq = seq_sum
    else:
        raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, "
                         f"got {mode!r}")
    return (per_seq * has_tokens).sum(), has_tokens.sum()


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str = "token_mean"):
    total, count = aggregate_parts(loss_BT, mask_BT, mode)
    return total / count.clamp(min=1)


def _ratio_stats(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict:
    valid = mask.bool()
    # approx KL(old || new) from samples of old, with r = new / old (Schulman's k1, k3).
    stats = {
        "approxkl": masked_mean(-log_ratio, mask).detach(),
        "approxkl_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
    }
    if valid.any():
        stats["ratio_max"] = ratio[valid].max().detach()
        stats["ratio_min"] = ratio[valid].min().detach()
    return stats


def _clipped_surrogate(log_ratio, advantages_BT, clip_eps):
    """max(-A r, -A clip(r)), and whether the clipped branch was taken."""
    ratio = torch.exp(log_ratio)
    surr1 = -advantages_BT * ratio
    surr2 = -advantages_BT * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    return ratio, torch.max(surr1, surr2), surr2 > surr1


def policy_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor,
                advantages_BT: torch.Tensor, mask_BT: torch.Tensor, clip_eps: float = 0.2,
                dual_clip: float | None = None, agg: str = "token_mean",
                token_weights_BT: torch.Tensor | None = None):
    """Clipped surrogate: max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(logp - logp_old).

    ``dual_clip`` c > 1 (Ye et al. 2020) also bounds the loss by -c A where A < 0, so a
    huge ratio on a bad action cannot dominate. ``token_weights_BT`` (constants, e.g. the
    truncated importance weights of a rollout/training mismatch correction) multiply each
    token's loss. Returns (total, count, stats)."""
    mask = mask_BT.to(logprobs_BT.dtype)
    log_ratio = logprobs_BT - old_logprobs_BT
    ratio, loss, clipped = _clipped_surrogate(log_ratio, advantages_BT, clip_eps)
    stats = {"clipfrac": masked_mean(clipped.to(mask.dtype), mask)}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bounded = torch.min(loss, -advantages_BT * dual_clip)
        dual_hit = (advantages_BT < 0) & (bounded < loss)
        loss = torch.where(advantages_BT < 0, bounded, loss)
        stats["dual_clipfrac"] = masked_mean(dual_hit.to(mask.dtype), mask)
    if token_weights_BT is not None:
        loss = loss * token_weights_BT.detach()
    stats.update(_ratio_stats(log_ratio.detach(), ratio.detach(), mask))
    total, count = aggregate_parts(loss, mask, agg)
    return total, count, stats


def decoupled_policy_loss(logprobs_BT: torch.Tensor, proximal_logprobs_BT: torch.Tensor,
                          behavior_logprobs_BT: torch.Tensor, advantages_BT: torch.Tensor,
                          mask_BT: torch.Tensor, clip_eps: float = 0.2,
                          behavior_weight_cap: float | None = None, agg: str = "token_mean"):
    """AReaL's decoupled PPO objective (Fu et al. 2025): the clip is taken around the
    *proximal* policy (log-probs recomputed by the current weights before the mini-batch
    updates), and the off-policy gap to the *behaviour* policy that sampled the tokens is
    corrected by the importance weight exp(proximal - behaviour). Tokens whose weight
    exceeds ``behavior_weight_cap`` are dropped from the loss (weight 0), as in AReaL."""
    mask = mask_BT.to(logprobs_BT.dtype)
    log_ratio = logprobs_BT - proximal_logprobs_BT
    ratio, loss, clipped = _clipped_surrogate(log_ratio, advantages_BT, clip_eps)
    behavior_weight = torch.exp(proximal_logprobs_BT - behavior_logprobs_BT).detach()
    kept = mask.bool()
    if behavior_weight_cap is not None:
        kept = kept & (behavior_weight <= behavior_weight_cap)
    behavior_weight = torch.where(kept, behavior_weight, torch.zeros_like(behavior_weight))
    loss = loss * behavior_weight
    stats = {"clipfrac": masked_mean(clipped.to(mask.dtype), mask),
             "behavior_weight_mean": masked_mean(behavior_weight, kept.to(mask.dtype)),
             "behavior_capped_frac": masked_mean((mask.bool() & ~kept).to(mask.dtype), mask)}
    stats.update(_ratio_stats(log_ratio.detach(), ratio.detach(), mask))
    total, count = aggregate_parts(loss, mask, agg)
    return total, count, stats


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, cliprange_value: float | None = 0.2,
               agg: str = "token_mean", coef: float = 0.5):
    """coef * max((V - R)^2, (V_clipped - R)^2) with V_clipped within +-cliprange_value of
    the old values (OpenAI baselines); plain coef * (V - R)^2 when ``cliprange_value`` is
    None. Returns (total, count, stats)."""
    mask = mask_BT.to(values_BT.dtype)
    loss_unclipped = (values_BT - returns_BT).square()
    stats = {}
    if cliprange_value is not None:
        clipped = old_values_BT + (values_BT - old_values_BT).clamp(-cliprange_value,
                                                                    cliprange_value)
        loss_clipped = (clipped - returns_BT).square()
        loss = torch.max(loss_unclipped, loss_clipped)
        stats["clipfrac"] = masked_mean((loss_clipped > loss_unclipped).to(mask.dtype), mask)
    else:
        loss = loss_unclipped
        stats["clipfrac"] = torch.zeros((), dtype=values_BT.dtype)
    stats["vpred_mean"] = masked_mean(values_BT.detach(), mask)
    total, count = aggregate_parts(coef * loss, mask, agg)
    return total, count, stats


def entropy_bonus(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float,
                  agg: str = "token_mean"):
    """-coef * entropy, to be added to the policy loss: (total, count)."""
    total, count = aggregate_parts(-coef * entropy_BT, mask_BT, agg)
    return total, count


def ptx_loss(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor):
    """Next-token NLL on pretraining/SFT data (InstructGPT's PPO-ptx): (total, count)."""
    return aggregate_parts(-logprobs_BT, mask_BT, "token_mean")


def ppo_ptx_objective(ppo_loss: torch.Tensor, ptx_nll: torch.Tensor, ptx_coef: float):
    """InstructGPT's objective: the PPO loss plus ``ptx_coef`` times the pretraining NLL
    (each already aggregated over its own tokens)."""
    return ppo_loss + ptx_coef * ptx_nll


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over valid tokens (1 is perfect, <= 0 is useless)."""
    var_returns = masked_var(returns_BT, mask_BT, unbiased=False)
    var_residual = masked_var(returns_BT - values_BT, mask_BT, unbiased=False)
    if var_returns <= 0:
        return torch.tensor(float("nan"))
    return 1.0 - var_residual / var_returns
