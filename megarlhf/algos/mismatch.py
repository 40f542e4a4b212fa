"""The rollout/training mismatch: the sampler's log-probs and the trainer's differ (other
kernels, precision, layouts); truncated importance sampling and sequence masking correct
the policy loss for it."""

from __future__ import annotations

import torch


def mismatch_correction(old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor,
                        mask_BT: torch.Tensor, *, is_cap: float | None = None,
                        mask_low: float | None = None, mask_high: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The policy loss's mask and token weights from the trainer/sampler ratio
    r = p_train / p_rollout: truncated importance weights min(r, ``is_cap``), and whole
    samples dropped when their per-token geometric-mean ratio leaves [``mask_low``,
    ``mask_high``] (None: no bound). Returns (policy mask (B, T), weights (B, T),
    ``rollout_corr/*`` metrics)."""
    mask = mask_BT
    log_r = (old_logprobs_BT - rollout_logprobs_BT) * mask
    valid = mask.bool()
    weights = torch.ones_like(mask)
    capped = torch.zeros((), dtype=torch.float32)
    if is_cap is not None:
        r = torch.exp(log_r)
        weights = torch.where(valid, r.clamp(max=is_cap), weights)
        capped = ((r > is_cap) & valid).float().sum()
    tokens = mask.sum(dim=1)
    seq_ratio = torch.exp(log_r.sum(dim=1) / tokens.clamp(min=1))
    keep = torch.ones_like(seq_ratio, dtype=torch.bool)
    if mask_low is not None:
        keep &= seq_ratio >= mask_low
    if mask_high is not None:
        keep &= seq_ratio <= mask_high
    n = max(float(mask.sum()), 1.0)
    token_r = torch.exp(log_r[valid]) if valid.any() else torch.ones(1)
    has_tokens = tokens > 0
    metrics = {
        # KL(rollout || train) from the sampler's samples: k3 and k1 per token
        "rollout_corr/kl": float(((torch.expm1(log_r) - log_r) * mask).sum()) / n,
        "rollout_corr/kl_k1": float((-log_r * mask).sum()) / n,
        "rollout_corr/ratio_max": float(token_r.max()),
        "rollout_corr/ratio_min": float(token_r.min()),
        "rollout_corr/masked_fraction":
            float((~keep & has_tokens).float().sum()) / max(float(has_tokens.sum()), 1.0),
        "rollout_corr/is_capped_fraction": float(capped) / n,
    }
    return mask * keep.unsqueeze(1).to(mask.dtype), weights, metrics
