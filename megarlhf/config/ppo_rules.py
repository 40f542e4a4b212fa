"""PPO settings that span sections, and settings that would silently do nothing."""

from __future__ import annotations

from megarlhf.config.loader import written_fields
from megarlhf.config.schema import Config


def check_ppo(cfg: Config) -> None:
    """PPO settings that span sections, and settings that would silently do nothing (a
    field counts as set when the config file or an override wrote it)."""
    ppo, rollout, data = cfg.ppo, cfg.rollout, cfg.data

    def said(section: str, name: str) -> bool:
        return name in written_fields(getattr(cfg, section))

    if not ppo.kl_reward_on and said("ppo", "init_kl_coef") and ppo.init_kl_coef > 0:
        raise ValueError(
            f"ppo.init_kl_coef={ppo.init_kl_coef} has no effect: the KL is not in the reward "
            f"(ppo.advantage_estimator={ppo.advantage_estimator}, ppo.kl_in_reward="
            f"{ppo.kl_in_reward}). Regularise with ppo.kl_loss_coef, or set "
            "ppo.kl_in_reward=true")
    if not ppo.kl_loss_coef and said("ppo", "kl_loss_estimator"):
        raise ValueError("ppo.kl_loss_estimator has no effect with ppo.kl_loss_coef=0")
    if ppo.advantage_estimator != "grpo" and said("ppo", "grpo_normalization"):
        raise ValueError(f"ppo.grpo_normalization has no effect with "
                         f"ppo.advantage_estimator={ppo.advantage_estimator}")
    if ppo.policy_loss != "decoupled" and ppo.behavior_weight_cap is not None:
        raise ValueError("ppo.behavior_weight_cap applies to ppo.policy_loss=decoupled only")
    correction = [name for name in ("rollout_is_cap", "rollout_mask_low", "rollout_mask_high")
                  if getattr(ppo, name) is not None]
    if ppo.policy_loss == "decoupled":
        correction.append("policy_loss=decoupled")
    if correction and not rollout.recompute_logprobs:
        raise ValueError(
            f"ppo.{correction[0]} compares the trainer's log-probs with the sampler's, but "
            "rollout.recompute_logprobs=false uses the sampler's as the old log-probs (the "
            "ratio is 1): set rollout.recompute_logprobs=true")
    if (ppo.ptx_coef > 0) != bool(data.ptx_path):
        raise ValueError("PPO-ptx needs both ppo.ptx_coef > 0 and data.ptx_path "
                         f"(got ppo.ptx_coef={ppo.ptx_coef}, data.ptx_path={data.ptx_path!r})")
    if ppo.ptx_batch_size is not None and ppo.ptx_coef == 0:
        raise ValueError("ppo.ptx_batch_size has no effect with ppo.ptx_coef=0")
    if ppo.overlong_buffer >= rollout.max_new_tokens:
        raise ValueError(f"ppo.overlong_buffer={ppo.overlong_buffer} must be below "
                         f"rollout.max_new_tokens={rollout.max_new_tokens}")
    if said("ppo", "max_sampling_rounds") and not ppo.dynamic_sampling:
        raise ValueError("ppo.max_sampling_rounds has no effect without ppo.dynamic_sampling")
    if said("ppo", "overlong_penalty") and not ppo.overlong_buffer:
        raise ValueError("ppo.overlong_penalty has no effect with ppo.overlong_buffer=0")
