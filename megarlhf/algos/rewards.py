"""From reward-model scores to per-token rewards.

Layout convention: response tensors are (B, T), left-aligned (token 0 of the response at
column 0), with ``mask_BT`` 1 on real response tokens (the stop token included) and 0 on
padding after them. The score is added at the last real response token (DeepSpeed-Chat,
OpenRLHF); TRL's PPOTrainer adds it one position later (see tests/test_algos_trl.py).
"""

from __future__ import annotations

import torch

from megarlhf.algos.masked import last_valid_index


def truncate_after_stop(responses_BT: torch.Tensor, mask_BT: torch.Tensor,
                        stop_token_ids: list[int] | tuple[int, ...], pad_token_id: int,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token (the stop token is kept).

    Returns (responses with pad after the cut, the new mask, ``has_stop`` (B,) bool: a
    stop token occurred among the real tokens).
    """
    if not stop_token_ids:
        return responses_BT, mask_BT, torch.zeros(responses_BT.shape[0], dtype=torch.bool)
    valid = mask_BT.bool()
    is_stop = torch.isin(responses_BT, torch.tensor(list(stop_token_ids),
                                                    device=responses_BT.device)) & valid
    has_stop = is_stop.any(dim=-1)
    T = responses_BT.shape[-1]
    first_stop = torch.where(has_stop, is_stop.to(torch.int8).argmax(dim=-1),
                             torch.full_like(has_stop, T, dtype=torch.long))
    cols = torch.arange(T, device=responses_BT.device)
    keep = valid & (cols.unsqueeze(0) <= first_stop.unsqueeze(1))
    return responses_BT.masked_fill(~keep, pad_token_id), keep.to(mask_BT.dtype), has_stop


def apply_missing_stop_rule(scores_B: torch.Tensor, has_stop_B: torch.Tensor,
                            penalty: float | None, mode: str = "replace") -> torch.Tensor:
    """Responses without a stop token: ``replace`` their score by ``penalty``
    (lm-human-preferences, default -1) or ``subtract`` it (TRL's ``missing_eos_penalty``).
    ``penalty=None`` leaves scores alone."""
    if penalty is None:
        return scores_B
    if mode == "replace":
        return torch.where(has_stop_B, scores_B, torch.full_like(scores_B, penalty))
    if mode == "subtract":
        return torch.where(has_stop_B, scores_B, scores_B - penalty)
    raise ValueError(f"missing-stop mode must be 'replace' or 'subtract', got {mode!r}")


def overlong_penalty(lengths_B: torch.Tensor, max_len: int, buffer: int,
                     penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the score: 0 up to ``max_len - buffer``
    tokens, then falling linearly to ``-penalty`` at ``max_len`` (and beyond)."""
    if buffer <= 0:
        return torch.zeros(lengths_B.shape, dtype=torch.float32)
    over = (lengths_B.to(torch.float32) - (max_len - buffer)).clamp(min=0.0) / buffer
    return -penalty * over.clamp(max=1.0)


def shape_scores(scores_B: torch.Tensor, has_stop_B: torch.Tensor, lengths_B: torch.Tensor, *,
                 missing_stop_penalty: float | None, missing_stop_mode: str, max_len: int,
                 overlong_buffer: int, overlong_penalty_value: float) -> torch.Tensor:
    """The score a sample trains on: :func:`apply_missing_stop_rule`, then DAPO's
    :func:`overlong_penalty` for its ``lengths_B`` response tokens."""
    if missing_stop_penalty is not None:
        scores_B = apply_missing_stop_rule(scores_B, has_stop_B, missing_stop_penalty,
                                           missing_stop_mode)
    return scores_B + overlong_penalty(lengths_B, max_len, overlong_buffer,
                                       overlong_penalty_value)


def informative_groups(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G,) True for each group of ``group_size`` consecutive samples whose scores are not
    all equal (DAPO's dynamic sampling keeps those: an all-equal group has zero advantage
    under a group baseline)."""
    spread = scores_B.view(-1, group_size)
    return spread.max(dim=1).values > spread.min(dim=1).values


def fit_score_normalization(raw_scores: torch.Tensor) -> tuple[float, float]:
    """(gain, bias) so that gain * raw + bias has mean 0 and std 1 on ``raw_scores``
    (Ziegler et al.: measured on SFT samples after reward-model training)."""
    mean = raw_scores.double().mean()
    std = raw_scores.double().std(unbiased=False)
    if not torch.isfinite(std) or std < 1e-12:
        raise ValueError("cannot normalise reward scores with zero spread "
                         f"({raw_scores.numel()} scores, std {float(std):.3g})")
    return float(1.0 / std), float(-mean / std)


def normalize_scores(raw_scores_B: torch.Tensor, gain: float, bias: float) -> torch.Tensor:
    return raw_scores_B * gain + bias


def shape_rewards(scores_B: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor,
                  kl_coef: float, clip_reward_value: float | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """r_t = -kl_coef * KL_t on every response token, plus the (clipped) score at the last
    response token. Returns (rewards_BT, non_score_rewards_BT); zero after each end. A row
    without any response token receives nothing."""
    mask = mask_BT.to(kl_BT.dtype)
    non_score = -kl_coef * kl_BT * mask
    scores = scores_B.to(kl_BT.dtype)
    if clip_reward_value is not None:
        scores = scores.clamp(-clip_reward_value, clip_reward_value)
    rewards = non_score.clone()
    last = last_valid_index(mask_BT)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows]
    return rewards, non_score
