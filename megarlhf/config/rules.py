"""Checks that span settings: a model against its layout and the world size, the
inference layout, precision, and the PPO settings that span sections or would silently
do nothing."""

from __future__ import annotations

from megarlhf.config.fields import _require
from megarlhf.config.layout import Layout
from megarlhf.config.loader import written_fields
from megarlhf.config.model import ModelConfig
from megarlhf.config.tree import Config


def check_model_layout(where: str, model: ModelConfig, layout: Layout,
                       world_size: int | None = None, model_name: str = "model") -> None:
    """The one place where a model's split is checked: heads, query groups and MLP width
    divisible by TP, layers by the pipeline chunks, the world by TP x PP. ``where`` names
    the layout's config section (``parallel``, ``roles.critic.parallel``) and
    ``model_name`` the model's (``model``, ``roles.reward.model``) in the messages."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    _require(model.num_attention_heads % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide {model_name}.num_attention_heads={model.num_attention_heads}")
    _require(model.query_groups % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide the number of query groups ({model_name}.num_query_groups="
             f"{model.query_groups})")
    _require(model.ffn_size % tp == 0, f"{where}.tensor_model_parallel_size", tp,
             f"must divide the MLP width {model.ffn_size} of {model_name}")
    if vpp is not None:
        _require(pp >= 2 and vpp >= 2, f"{where}.virtual_pipeline_model_parallel_size", vpp,
                 f"needs pipeline_model_parallel_size >= 2 (it is {pp}) and a value >= 2")
    chunks = pp * (vpp or 1)
    _require(model.num_layers % chunks == 0, f"{model_name}.num_layers", model.num_layers,
             f"must be divisible by the number of pipeline chunks {chunks} "
             f"({where}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)")
    if world_size is not None:
        _require(world_size % (tp * pp) == 0, "world size", world_size,
                 f"must be a multiple of tensor x pipeline parallel size = {tp} x {pp} = "
                 f"{tp * pp} ({where})")


def check_rollout_layout(model: ModelConfig, rollout_tp: int, world_size: int) -> None:
    """The inference layout: TP = rollout.tensor_parallel_size, no PP, DP replicas."""
    _require(world_size % rollout_tp == 0, "rollout.tensor_parallel_size", rollout_tp,
             f"must divide the world size {world_size}")
    _require(model.num_attention_heads % rollout_tp == 0
             and model.query_groups % rollout_tp == 0, "rollout.tensor_parallel_size",
             rollout_tp, f"must divide the actor's num_attention_heads="
             f"{model.num_attention_heads} and query groups {model.query_groups}")


def validate_layout(cfg: Config, world_size: int) -> None:
    """Check that ``cfg.model`` can be split as ``cfg.parallel`` asks on ``world_size``
    processes (SFT, RM, score; PPO checks every role in ``roles.spec``). Runs before
    any process group exists."""
    par, model = cfg.parallel, cfg.model
    check_model_layout("parallel", model, par.layout, world_size)
    check_rollout_layout(model, cfg.rollout.tensor_parallel_size, world_size)
    check_precision(model)


def check_precision(model: ModelConfig, where: str = "model") -> None:
    if model.fp8.enabled and model.params_dtype == "float32":
        raise ValueError(f"{where}.fp8.enabled=true needs {where}.params_dtype bfloat16 or "
                         "float16 (fp8 training keeps master weights in the optimizer)")



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
