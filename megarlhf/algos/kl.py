"""Per-token KL estimators and the KL-coefficient controllers.

Estimators of KL(policy || reference) from samples of the policy, with
log r = logp_ref - logp_policy (http://joschu.net/blog/kl-approx.html):
k1 = -log r (unbiased, high variance), k2 = (log r)^2 / 2 (biased, low variance),
k3 = (r - 1) - log r (unbiased, low variance, always >= 0), abs = |log r|.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_per_token(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor,
                 mask_BT: torch.Tensor | None = None, estimator: str = "k1") -> torch.Tensor:
    """(B, T) per-token KL estimate, zero where ``mask_BT`` is 0."""
    log_r = ref_logprobs_BT - logprobs_BT
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    elif estimator == "abs":
        kl = log_r.abs()
    else:
        raise ValueError(f"KL estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    return kl if mask_BT is None else kl * mask_BT.to(kl.dtype)


@dataclass
class FixedKLController:
    """A constant beta."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019: a proportional controller steering the sequence KL to
    ``target``. error = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + error * n / horizon,
    where n is the number of samples in the batch that measured KL."""

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(kind: str, init_kl_coef: float, target: float, horizon: int):
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target, horizon)
    raise ValueError(f"KL controller must be 'fixed' or 'adaptive', got {kind!r}")
