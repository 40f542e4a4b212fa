"""Offline objectives on frozen-model outputs: DPO (and cDPO, IPO) on preference pairs,
and distillation from a teacher's top-k log-probs. Pure torch; the steps in
``engine.steps`` feed them sequence or per-position log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(policy_chosen_B: torch.Tensor, policy_rejected_B: torch.Tensor,
             ref_chosen_B: torch.Tensor, ref_rejected_B: torch.Tensor, *, beta: float,
             loss: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss, and the implicit rewards beta * (log pi - log ref) of chosen and
    rejected (detached), as TRL's ``DPOTrainer``:

    - ``sigmoid`` (Rafailov et al.): -log sigmoid(beta h), with cDPO's label smoothing e:
      -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h);
    - ``ipo`` (Azar et al.): (h - 1 / (2 beta))^2, on per-token mean log-probs (the caller
      averages, as TRL does);
    where h = (pi_c - ref_c) - (pi_r - ref_r), inputs summed (or averaged) over the
    response tokens."""
    h = (policy_chosen_B - ref_chosen_B) - (policy_rejected_B - ref_rejected_B)
    if loss == "sigmoid":
        losses = (-F.logsigmoid(beta * h) * (1 - label_smoothing)
                  - F.logsigmoid(-beta * h) * label_smoothing)
    elif loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss!r}")
    chosen = beta * (policy_chosen_B - ref_chosen_B).detach()
    rejected = beta * (policy_rejected_B - ref_rejected_B).detach()
    return losses, chosen, rejected


def _rest(logprobs_BTK: torch.Tensor) -> torch.Tensor:
    """log(1 - sum_k p_k): the mass outside the k buckets (clamped away from log 0)."""
    mass = logprobs_BTK.exp().sum(-1).clamp(max=1.0 - 1e-6)
    return torch.log1p(-mass)


def topk_kl(student_BTK: torch.Tensor, teacher_BTK: torch.Tensor,
            divergence: str = "forward") -> torch.Tensor:
    """Per-position KL between teacher and student over k + 1 buckets: the teacher's top-k
    tokens (both models' log-probs of those ids) and everything else as one bucket.

    - ``forward``: KL(teacher || student) = sum_k p_t (log p_t - log p_s) + r_t (log r_t -
      log r_s), mass-covering; equals the full-vocabulary forward KL when the top-k hold
      all of the teacher's mass;
    - ``reverse``: KL(student || teacher) on the same buckets, mode-seeking.
    Returns (B, T); differentiable in ``student_BTK``."""
    t = torch.cat([teacher_BTK, _rest(teacher_BTK).unsqueeze(-1)], dim=-1)
    s = torch.cat([student_BTK, _rest(student_BTK).unsqueeze(-1)], dim=-1)
    if divergence == "forward":
        return (t.exp() * (t - s)).sum(-1)
    if divergence == "reverse":
        return (s.exp() * (s - t)).sum(-1)
    raise ValueError(f"unknown divergence {divergence!r}")
