"""RL algorithms as pure tensor functions: no model, no process group.

Shapes: B samples, T response tokens (left-aligned), masks 1 on valid response tokens.
"""

from megarlhf.algos.advantages import (
    broadcast_to_tokens, discounted_returns, estimate_advantages, gae, grpo_advantages, grpo_token_advantages, reinforce_pp_advantages,
    rloo_advantages)
from megarlhf.algos.ema import ParameterEMA
from megarlhf.algos.experience import BatchSizes, Experience, exact_div
from megarlhf.algos.kl import (
    AdaptiveKLController, FixedKLController, kl_per_token, make_kl_controller)
from megarlhf.algos.losses import (
    aggregate, aggregate_parts, decoupled_policy_loss, entropy_bonus, explained_variance,
    policy_loss, ppo_ptx_objective, ptx_loss, value_loss)
from megarlhf.algos.masked import (
    last_valid_index, masked_mean, masked_sum, masked_var, masked_whiten)
from megarlhf.algos.mismatch import mismatch_correction
from megarlhf.algos.rewards import (
    apply_missing_stop_rule, fit_score_normalization, informative_groups, normalize_scores,
    overlong_penalty, shape_rewards, shape_scores, truncate_after_stop)
from megarlhf.algos.targets import learning_targets

__all__ = [
    "AdaptiveKLController", "BatchSizes", "Experience", "FixedKLController", "ParameterEMA",
    "aggregate", "aggregate_parts", "apply_missing_stop_rule", "broadcast_to_tokens",
    "decoupled_policy_loss", "discounted_returns", "entropy_bonus", "estimate_advantages", "exact_div",
    "explained_variance", "fit_score_normalization", "gae", "grpo_advantages", "grpo_token_advantages",
    "informative_groups", "kl_per_token", "learning_targets", "mismatch_correction", "last_valid_index", "make_kl_controller", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "normalize_scores", "overlong_penalty", "policy_loss", "ppo_ptx_objective",
    "ptx_loss", "reinforce_pp_advantages", "rloo_advantages", "shape_rewards", "shape_scores",
    "truncate_after_stop", "value_loss",
]
