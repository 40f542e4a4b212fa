"""Every refusal that involves more than one setting, in one module.

- Within one section (``model.hidden_size`` against ``model.num_attention_heads``):
  :func:`check_section`, which the loader applies to every section it builds and
  :func:`~megarlhf.config.loader.overlay` to every section it merges, so no loaded config
  has one of them broken.
- Across sections, and against what a stage reads: a model against its layout and the
  world size, the inference layout, precision (called for every role by
  ``roles.spec``); PPO's settings (:func:`check_ppo`); the roles a stage does not read
  (:func:`check_roles`); the Slurm job against the layouts (:func:`check_launch`). The
  stages and commands call them before any work.

A value that is wrong on its own (a negative learning rate) is refused beside its field,
by its section's ``__post_init__``. Refusals that need a file (a checkpoint's shapes, the
tokenizer's vocabulary) are made where the file is read.
"""

from __future__ import annotations

from megarlhf.config.budget import longest_ppo_sample
from megarlhf.config.data import DataConfig
from megarlhf.config.fields import ConfigError, require
from megarlhf.config.layout import Layout
from megarlhf.config.model import ModelConfig
from megarlhf.config.offline import DPOConfig
from megarlhf.config.parallel import ParallelConfig
from megarlhf.config.ppo import PPOConfig
from megarlhf.config.training import OptimizerConfig
from megarlhf.config.tree import Config
from megarlhf.config.written import Written

PPO_ROLES = ("actor", "critic", "reference", "reward")
ROLES = (*PPO_ROLES, "teacher", "judge")


# ------------------------------------------------------------------ within one section

def _model(model: ModelConfig) -> None:
    if model.head_dim is None:
        require(model.hidden_size % model.num_attention_heads == 0, "model.hidden_size",
                model.hidden_size,
                f"must be divisible by model.num_attention_heads={model.num_attention_heads} "
                "(or set model.head_dim)")
    scaling = model.rope_scaling
    if scaling.type != "none":
        require(model.arch == "llama", "model.rope_scaling.type", scaling.type,
                "applies to RoPE models (model.arch=llama); gpt2 has learned positions")
    if scaling.type == "llama3":
        require(scaling.high_freq_factor > scaling.low_freq_factor,
                "model.rope_scaling.high_freq_factor", scaling.high_freq_factor,
                f"must exceed model.rope_scaling.low_freq_factor={scaling.low_freq_factor}")
    if model.num_query_groups is not None:
        require(model.num_query_groups >= 1
               and model.num_attention_heads % model.num_query_groups == 0,
               "model.num_query_groups", model.num_query_groups,
               f"must divide model.num_attention_heads={model.num_attention_heads}")


def _parallel(par: ParallelConfig) -> None:
    vpp = par.virtual_pipeline_model_parallel_size
    if vpp is not None:
        require(vpp >= 2 and par.pipeline_model_parallel_size >= 2,
               "parallel.virtual_pipeline_model_parallel_size", vpp,
               "must be >= 2 and needs parallel.pipeline_model_parallel_size >= 2 "
               "(or null to disable)")


def _data(data: DataConfig) -> None:
    require(data.max_seq_len > data.max_prompt_len, "data.max_seq_len", data.max_seq_len,
           f"must exceed data.max_prompt_len={data.max_prompt_len}")


def _optimizer(opt: OptimizerConfig) -> None:
    require(0 <= opt.min_lr <= opt.lr, "optimizer.min_lr", opt.min_lr,
           f"must be in [0, optimizer.lr={opt.lr}]")


def _ppo(ppo: PPOConfig) -> None:
    if ppo.dynamic_sampling:
        require(ppo.group_size >= 2, "ppo.group_size", ppo.group_size,
               "must be >= 2 with ppo.dynamic_sampling (it filters groups)")
    if not ppo.kl_reward_on and ppo.kl.controller == "adaptive":
        raise ValueError(
            "ppo.kl.controller=adaptive tunes the KL coefficient of the reward, but the "
            f"KL is not in the reward (ppo.kl.in_reward={ppo.kl.in_reward}, estimator "
            f"{ppo.advantage_estimator}): set ppo.kl.in_reward=true or "
            "ppo.kl.controller=fixed")
    if ppo.decoupled_loss and (ppo.dual_clip is not None or ppo.correction.is_cap is not None):
        raise ConfigError(f"ppo.policy_loss={_loss_name(ppo)}: the decoupled loss has its own "
                          "importance weight and no dual clip: leave ppo.correction.is_cap and "
                          "ppo.dual_clip null (or set ppo.policy_loss=ppo)")
    if ppo.advantage_estimator in ("grpo", "rloo"):
        require(ppo.group_size >= 2, "ppo.group_size", ppo.group_size,
               f"must be >= 2 for ppo.advantage_estimator={ppo.advantage_estimator}")


def _loss_name(ppo: PPOConfig) -> str:
    """``ppo.policy_loss`` as written, or what null resolved to and why."""
    if ppo.policy_loss is not None:
        return ppo.policy_loss
    return f"null (decoupled: the default with ppo.max_staleness={ppo.max_staleness})" \
        if ppo.decoupled_loss else "null (ppo)"


def _dpo(dpo: DPOConfig) -> None:
    require(dpo.loss == "sigmoid" or dpo.label_smoothing == 0.0,
           "dpo.label_smoothing", dpo.label_smoothing,
           "applies to the sigmoid loss only (dpo.loss=ipo)")
    require((dpo.gold_reward_fn is None) == (dpo.gold_eval_path is None),
           "dpo.gold_reward_fn", dpo.gold_reward_fn,
           "and dpo.gold_eval_path go together: set both or neither")


SECTION_RULES = {ModelConfig: _model, ParallelConfig: _parallel, DataConfig: _data,
                 OptimizerConfig: _optimizer, PPOConfig: _ppo, DPOConfig: _dpo}


def check_section(section) -> None:
    """The rules between the fields of one section (raises ``ValueError``)."""
    rule = SECTION_RULES.get(type(section))
    if rule is not None:
        rule(section)


# ------------------------------------------------------------------ across sections

def check_context_parallel(where: str, model: ModelConfig, layout: Layout,
                           model_name: str) -> None:
    """What context parallelism does not take yet, refused naming the setting:
    multi-latent attention (its own rotary embedding), TransformerEngine's layers (their
    attention splits the sequence its own way, which megarlhf has not checked against one
    process) and the interleaved pipeline schedule."""
    if layout.cp == 1:
        return
    field = f"{where}.context_parallel_size"
    for flag, what in ((model.mla.enabled, f"multi-latent attention ({model_name}.mla)"),
                       (model.sliding_window is not None,
                        f"sliding-window attention ({model_name}.sliding_window)"),
                       (model.attention_sinks,
                        f"attention sinks ({model_name}.attention_sinks)"),
                       (model.transformer_impl == "transformer_engine",
                        f"TransformerEngine's layers ({model_name}.transformer_impl)"),
                       (layout.vpp is not None,
                        f"the interleaved pipeline ({where}.virtual_pipeline_model_parallel_"
                        f"size), whose stages exchange one fixed length over gloo")):
        require(not flag, field, layout.cp, f"does not take {what} yet: use 1")


def check_model_layout(where: str, model: ModelConfig, layout: Layout,
                       world_size: int | None = None, model_name: str = "model",
                       trained: bool = False) -> None:
    """The one place where a model's split is checked: heads, query groups and MLP width
    divisible by TP, layers by the pipeline chunks (and recomputation's groups of layers
    within one), the world by TP x PP. ``where`` names
    the layout's config section (``parallel``, ``roles.critic.parallel``) and
    ``model_name`` the model's (``model``, ``roles.reward.model``) in the messages.
    ``trained``: the model trains at this layout (a mixture of experts then needs sequence
    parallelism at TP > 1, as megatron-core does)."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    require(model.num_attention_heads % tp == 0, f"{where}.tensor_model_parallel_size", tp,
            f"must divide {model_name}.num_attention_heads={model.num_attention_heads}")
    require(model.query_groups % tp == 0, f"{where}.tensor_model_parallel_size", tp,
            f"must divide the number of query groups ({model_name}.num_query_groups="
            f"{model.query_groups})")
    require(model.ffn_size % tp == 0, f"{where}.tensor_model_parallel_size", tp,
            f"must divide the MLP width {model.ffn_size} of {model_name}")
    check_latent_split(f"{where}.tensor_model_parallel_size", tp, model, model_name)
    if vpp is not None:
        require(pp >= 2 and vpp >= 2, f"{where}.virtual_pipeline_model_parallel_size", vpp,
                f"needs pipeline_model_parallel_size >= 2 (it is {pp}) and a value >= 2")
    chunks = pp * (vpp or 1)
    require(model.num_layers % chunks == 0, f"{model_name}.num_layers", model.num_layers,
            f"must be divisible by the number of pipeline chunks {chunks} "
            f"({where}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size)")
    cp = layout.cp
    if world_size is not None:
        names, sizes = ("tensor x pipeline", f"{tp} x {pp}") if cp == 1 else \
            ("tensor x pipeline x context", f"{tp} x {pp} x {cp}")
        require(world_size % (tp * pp * cp) == 0, "world size", world_size,
                f"must be a multiple of {names} parallel size = {sizes} = {tp * pp * cp} "
                f"({where})")
    check_context_parallel(where, model, layout, model_name)
    check_expert_layout(where, model, layout, world_size, model_name)
    require(not layout.sp or tp > 1, f"{where}.sequence_parallel", layout.sp,
            "needs tensor_model_parallel_size > 1 (it splits the sequence over the "
            "tensor-parallel ranks)")
    require(not (layout.sp and model.mla.enabled), f"{where}.sequence_parallel", layout.sp,
            f"does not take multi-latent attention ({model_name}.mla) yet: megarlhf gathers "
            "MLA's down projections on the layers themselves, which is not checked against "
            "one process with the sequence split; use TP without it, or TP=1")
    require(not (trained and model.moe.enabled and tp > 1 and not layout.sp),
            f"{where}.sequence_parallel", layout.sp,
            f"must be true to train the mixture of experts {model_name} at "
            f"tensor_model_parallel_size={tp}: megatron-core trains MoE layers at TP > 1 "
            "only with sequence parallelism")
    recompute = model.recompute
    if recompute.granularity == "full":
        per_chunk = model.num_layers // chunks
        if recompute.method == "uniform":
            require(per_chunk % recompute.num_layers == 0, f"{model_name}.recompute.num_layers",
                    recompute.num_layers, f"must divide the {per_chunk} layers of each "
                    f"pipeline chunk (method=uniform recomputes groups of that many)")
        else:
            require(recompute.num_layers <= per_chunk, f"{model_name}.recompute.num_layers",
                    recompute.num_layers, f"must be at most the {per_chunk} layers of each "
                    f"pipeline chunk (method=block)")


def check_latent_split(field: str, tp: int, model: ModelConfig, model_name: str) -> None:
    """Multi-latent attention over ``tp`` ranks: megatron splits the down projections'
    rows too (gathered after), and builds the direct query projection (no q_lora_rank)
    on its global tensor-parallel group, which megarlhf's per-role groups do not set."""
    mla = model.mla
    if not mla.enabled or tp == 1:
        return
    require(mla.q_lora_rank is not None, field, tp,
            f"must be 1 with {model_name}.mla.q_lora_rank=null (megatron-core builds that "
            "query projection on its global tensor-parallel group)")
    require(mla.q_lora_rank % tp == 0, field, tp,
            f"must divide {model_name}.mla.q_lora_rank={mla.q_lora_rank}")
    width = mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    require(width % tp == 0, field, tp,
            f"must divide {model_name}.mla.kv_lora_rank + qk_pos_emb_head_dim = {width}")


def check_expert_layout(where: str, model: ModelConfig, layout: Layout,
                        world_size: int | None, model_name: str) -> None:
    """A mixture-of-experts model's experts split over EP ranks, each expert over ETP; the
    world a multiple of ETP x EP x PP. A dense model with EP > 1 is refused (it would do
    nothing)."""
    ep, etp, pp = layout.ep, layout.expert_tp, layout.pp
    if not model.moe.enabled:
        require(ep == 1, f"{where}.expert_model_parallel_size", ep,
                f"must be 1: {model_name} is dense ({model_name}.moe.num_experts=0)")
        return
    experts = model.moe.num_experts
    require(experts % ep == 0, f"{where}.expert_model_parallel_size", ep,
            f"must divide {model_name}.moe.num_experts={experts}")
    require(model.expert_ffn_size % etp == 0, f"{where}.expert_tensor_parallel_size", etp,
            f"must divide the expert MLP width {model.expert_ffn_size} of {model_name}")
    require(etp == 1 or not model.linear_bias, f"{where}.expert_tensor_parallel_size", etp,
            f"must be 1 for {model_name}'s experts with biases ({model_name}.linear_bias, "
            "gpt-oss): megatron-core splits no expert's biases over tensor-parallel ranks")
    if model.moe.shared_expert_ffn_hidden_size:
        require(model.moe.shared_expert_ffn_hidden_size % layout.tp == 0,
                f"{where}.tensor_model_parallel_size", layout.tp,
                f"must divide {model_name}.moe.shared_expert_ffn_hidden_size="
                f"{model.moe.shared_expert_ffn_hidden_size}")
    if world_size is not None:
        require(world_size % (etp * ep * pp) == 0, "world size", world_size,
                f"must be a multiple of expert tensor x expert x pipeline parallel size = "
                f"{etp} x {ep} x {pp} = {etp * ep * pp} ({where})")


def check_rollout_layout(model: ModelConfig, rollout_tp: int, world_size: int) -> None:
    """The inference layout: TP = rollout.tensor_parallel_size, no PP, DP replicas."""
    require(world_size % rollout_tp == 0, "rollout.tensor_parallel_size", rollout_tp,
            f"must divide the world size {world_size}")
    require(model.num_attention_heads % rollout_tp == 0
            and model.query_groups % rollout_tp == 0, "rollout.tensor_parallel_size",
            rollout_tp, f"must divide the actor's num_attention_heads="
            f"{model.num_attention_heads} and query groups {model.query_groups}")
    check_latent_split("rollout.tensor_parallel_size", rollout_tp, model, "the actor's model")


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


def check_ppo(cfg: Config, written: Written, *, planning: bool = False) -> None:
    """PPO settings that span sections, the roles a PPO run has, and settings that would
    silently do nothing (a field counts as set when the config file or an override wrote
    it). ``planning`` (``megarlhf plan``): checkpoints may be missing."""
    ppo, rollout, data, roles = cfg.ppo, cfg.rollout, cfg.data, cfg.roles

    def said(section: str, name: str) -> bool:
        return f"{section}.{name}" in written

    if not ppo.kl_reward_on and said("ppo.kl", "init_coef") and ppo.kl.init_coef > 0:
        raise ConfigError(
            f"ppo.kl.init_coef={ppo.kl.init_coef} has no effect: the KL is not in the reward "
            f"(ppo.advantage_estimator={ppo.advantage_estimator}, ppo.kl.in_reward="
            f"{ppo.kl.in_reward}). Regularise with ppo.kl.loss_coef, or set "
            "ppo.kl.in_reward=true")
    if not ppo.kl.loss_coef and said("ppo.kl", "loss_estimator"):
        raise ConfigError("ppo.kl.loss_estimator has no effect with ppo.kl.loss_coef=0")
    if ppo.advantage_estimator != "grpo" and said("ppo", "grpo_normalization"):
        raise ConfigError(f"ppo.grpo_normalization has no effect with "
                         f"ppo.advantage_estimator={ppo.advantage_estimator}")
    if not ppo.decoupled_loss and ppo.correction.behavior_weight_cap is not None:
        raise ConfigError("ppo.correction.behavior_weight_cap applies to "
                          f"ppo.policy_loss=decoupled only (ppo.policy_loss={_loss_name(ppo)})")
    correction = [f"correction.{name}" for name in ("is_cap", "mask_low", "mask_high")
                  if getattr(ppo.correction, name) is not None]
    if ppo.decoupled_loss:
        correction.append(f"policy_loss={_loss_name(ppo)}")
    if correction and not rollout.recompute_logprobs:
        raise ConfigError(
            f"ppo.{correction[0]} compares the trainer's log-probs with the sampler's, but "
            "rollout.recompute_logprobs=false uses the sampler's as the old log-probs (the "
            "ratio is 1): set rollout.recompute_logprobs=true")
    if (ppo.ptx_coef > 0) != bool(data.ptx_path):
        raise ConfigError("PPO-ptx needs both ppo.ptx_coef > 0 and data.ptx_path "
                         f"(got ppo.ptx_coef={ppo.ptx_coef}, data.ptx_path={data.ptx_path!r})")
    if ppo.ptx_batch_size is not None and ppo.ptx_coef == 0:
        raise ConfigError("ppo.ptx_batch_size has no effect with ppo.ptx_coef=0")
    if rollout.placement.partial and ppo.max_staleness < 1:
        raise ConfigError("rollout.placement.partial needs ppo.max_staleness >= 1: at 0 no "
                          "update happens while a batch is sampled, so there is nothing to "
                          "take in flight")
    for name in ("sync_timeout_minutes", "request_timeout_minutes"):
        if said("rollout.placement", name) and rollout.placement.mode != "split":
            raise ConfigError(f"rollout.placement.{name} has no effect without "
                              "rollout.placement.mode=split (no weights or requests cross "
                              "between the processes)")
    if said("rollout.placement", "partial_kv") and not rollout.placement.partial:
        raise ConfigError("rollout.placement.partial_kv has no effect without "
                          "rollout.placement.partial=true")
    _kv_cache(cfg, said)
    if ppo.overlong_buffer >= rollout.max_new_tokens:
        raise ConfigError(f"ppo.overlong_buffer={ppo.overlong_buffer} must be below "
                         f"rollout.max_new_tokens={rollout.max_new_tokens}")
    longest = longest_ppo_sample(cfg)
    sample = "data.max_seq_len (an environment's episode)" if rollout.environment.name \
        else "data.max_seq_len (an agent's episode)" if rollout.agent.enabled \
        else "data.max_prompt_len + rollout.max_new_tokens"
    for field, budget in (("ppo.max_tokens_per_micro_batch", ppo.max_tokens_per_micro_batch),
                          ("rollout.forward_max_tokens_per_micro_batch",
                           rollout.forward_max_tokens_per_micro_batch)):
        if isinstance(budget, int) and budget < longest:
            raise ConfigError(
                f"{field}={budget} cannot hold the longest sample, {sample} = {longest} "
                f"tokens: a packed micro-batch takes whole samples, and one over the budget "
                f"would break the memory bound it sets. Set it to at least {longest}, or "
                f"auto (ppo.micro_batch_size x {longest} = {ppo.micro_batch_size * longest})")
    packing = [f for f in ("rollout.forward_max_tokens_per_micro_batch",
                           "ppo.max_tokens_per_micro_batch") if f in written]
    if said("rollout", "forward_micro_batch_size") and (
            rollout.forward_max_tokens_per_micro_batch is not None
            or isinstance(ppo.max_tokens_per_micro_batch, int)):
        raise ConfigError(f"rollout.forward_micro_batch_size has no effect: the experience "
                          f"passes are packed ({packing[0] if packing else 'a token budget'} "
                          "is set)")
    if said("ppo", "max_sampling_rounds") and not ppo.dynamic_sampling:
        raise ConfigError("ppo.max_sampling_rounds has no effect without ppo.dynamic_sampling")
    if said("ppo", "overlong_penalty") and not ppo.overlong_buffer:
        raise ConfigError("ppo.overlong_penalty has no effect with ppo.overlong_buffer=0")
    if roles.actor.checkpoint is None and not planning:
        raise ConfigError("the actor needs a checkpoint: set ppo.sft_checkpoint (or "
                          "roles.actor.checkpoint) to an SFT run's checkpoints")
    reward_model = roles.reward.checkpoint is not None
    agent, judge = rollout.agent, rollout.judge
    sources = [name for name, on in (
        ("rollout.rewards.fn", rollout.rewards.fn), ("rollout.rewards.url", rollout.rewards.url),
        ("rollout.environment.name", rollout.environment.name),
        (agent.name.split("=")[0], agent.enabled), ("rollout.judge.template", judge.enabled))
        if on]
    programmatic = bool(sources)
    which = sources[0] if sources else None
    if judge.enabled and len(sources) > 1:
        raise ConfigError(f"rollout.judge.template and {sources[0]} are two reward sources: "
                          "choose one")
    for name in ("chat", "pattern", "labels", "max_new_tokens", "log_verdicts"):
        if said("rollout.judge", name) and not judge.enabled:
            raise ConfigError(f"rollout.judge.{name} has no effect without "
                              "rollout.judge.template")
    if judge.enabled and roles.judge.checkpoint is None and not planning:
        raise ConfigError("rollout.judge.template needs the judge's checkpoint: set "
                          "roles.judge.checkpoint")
    for name in sorted(written.fields("roles.judge.parallel") - {"tensor_model_parallel_size"}):
        raise ConfigError(f"roles.judge.parallel.{name} has no effect: the judge generates "
                          "its verdicts at tensor parallelism only "
                          "(roles.judge.parallel.tensor_model_parallel_size), the rest of the "
                          "world data-parallel replicas")
    teacher = ppo.teacher
    if not reward_model and not programmatic and not planning and teacher.task_reward:
        raise ConfigError("set ppo.reward_checkpoint (or roles.reward.checkpoint), "
                          "rollout.rewards.fn, rollout.rewards.url, rollout.environment.name, "
                          "rollout.agent.entry or rollout.judge.template (or distil from a teacher alone: ppo.teacher.coef > 0 with "
                          "ppo.teacher.task_reward=false)")
    if not teacher.task_reward and (reward_model or programmatic):
        raise ConfigError("ppo.teacher.task_reward=false scores nothing with the task's "
                          "reward, but a reward source is set: remove it, or keep "
                          "ppo.teacher.task_reward=true")
    if not teacher.task_reward and not teacher.enabled:
        raise ConfigError("ppo.teacher.task_reward=false needs a teacher: set "
                          "ppo.teacher.coef > 0 and roles.teacher.checkpoint")
    if teacher.enabled and roles.teacher.checkpoint is None and not planning:
        raise ConfigError(f"ppo.teacher.coef={teacher.coef} needs the teacher's checkpoint: "
                          "set roles.teacher.checkpoint")
    for name in ("kl_in", "loss_estimator", "task_reward"):
        if said("ppo.teacher", name) and not teacher.enabled:
            raise ConfigError(f"ppo.teacher.{name} has no effect with ppo.teacher.coef=0")
    if said("ppo.teacher", "loss_estimator") and teacher.kl_in != "loss":
        raise ConfigError("ppo.teacher.loss_estimator has no effect with "
                          "ppo.teacher.kl_in=reward")
    for name in ("max_turns", "max_observation_tokens", "tool_format"):
        if said("rollout.environment", name) and not rollout.environment.name:
            raise ConfigError(f"rollout.environment.{name} has no effect without "
                              "rollout.environment.name")
    for name in ("model_name", "max_requests", "tool_format", "batch_wait_s"):
        if said("rollout.agent", name) and not agent.enabled:
            raise ConfigError(f"rollout.agent.{name} has no effect without "
                              "rollout.agent.entry or rollout.agent.command")
    if agent.enabled and not (rollout.rewards.fn or rollout.rewards.url):
        for name in ("workers", "batch"):
            if said("rollout.rewards", name):
                raise ConfigError(f"rollout.rewards.{name} has no effect with {agent.name} "
                                  "and no rollout.rewards.fn or url: each episode's agent "
                                  "runs in a process of its own")
    source = "rollout.environment.name" if rollout.environment.name else \
        agent.name.split("=")[0]
    if rollout.episodic and rollout.routing_replay != "none":
        raise ConfigError(f"rollout.routing_replay does not take {source} yet (the "
                          "turns' expert choices are not recorded)")
    if rollout.episodic and ppo.gold_reward_fn:
        raise ConfigError(f"ppo.gold_reward_fn has no effect with {source}: the "
                          "evaluation plays the episodes, and their return is "
                          "eval/gold_score")
    if reward_model and programmatic:
        raise ConfigError(f"both a reward-model checkpoint and {which} are set: choose one "
                          "reward source")
    if said("rollout.rewards", "retries") and not rollout.rewards.url:
        raise ConfigError("rollout.rewards.retries has no effect without rollout.rewards.url")
    if said("rollout.rewards", "error_score") and rollout.rewards.on_error != "penalty":
        raise ConfigError("rollout.rewards.error_score has no effect with "
                          "rollout.rewards.on_error=stop (the default): set "
                          "rollout.rewards.on_error=penalty")
    gae = ppo.advantage_estimator == "gae"
    if gae and roles.critic.checkpoint is None and ppo.critic_init == "reward" \
            and programmatic:
        raise ConfigError(f"ppo.critic_init=reward needs a reward-model checkpoint; "
                          f"with {which} use ppo.critic_init=sft or random")
    absent = {"critic": None if gae else "ppo.advantage_estimator is not gae",
              "reward": None if not programmatic
              else f"{which} replaces the reward model"}
    for name, why in absent.items():
        if why is not None and written.fields(f"roles.{name}"):
            raise ConfigError(f"{_role_block(name, written)} is configured but this run has "
                              f"no {name} ({why}): remove roles.{name}")
    check_roles(cfg, written, PPO_ROLES + (("teacher",) if teacher.enabled else ())
                + (("judge",) if judge.enabled else ()), "ppo")
    for name in ("reference", "reward", "teacher", "judge"):
        level = getattr(roles, name).offload
        if level not in (None, "none", "all"):
            raise ConfigError(f"roles.{name}.offload={level!r}: the {name} role is frozen "
                              "and has only parameters to move; use none or all")


def paged_kv_refusal(model: ModelConfig) -> str | None:
    """What in ``model`` the paged KV cache cannot decode (its decode slots then use the
    columns cache), or None. The built model is checked again at rollout
    (``inference.static_kv.unsupported``)."""
    if model.mla.enabled:
        return "multi-latent attention"
    if model.transformer_impl == "transformer_engine":
        return "TransformerEngine's attention"
    return None


def _kv_cache(cfg: Config, said) -> None:
    """The decode slots' KV cache settings: none without decode slots, the paged pool's
    size able to hold one sequence, on a model the paged cache decodes."""
    rollout = cfg.rollout
    paged = rollout.decode_slots is not None and rollout.kv_cache == "paged"
    if said("rollout", "kv_cache") and rollout.decode_slots is None:
        raise ConfigError("rollout.kv_cache has no effect without rollout.decode_slots (one "
                          "static batch has a cache of its own)")
    if said("rollout", "kv_block_tokens") and not paged:
        raise ConfigError("rollout.kv_block_tokens has no effect without rollout.decode_slots "
                          "and rollout.kv_cache=paged")
    if rollout.kv_cache_tokens is None:
        return
    longest = cfg.data.max_prompt_len + rollout.max_new_tokens - 1
    if rollout.kv_cache_tokens < longest:
        raise ConfigError(
            f"rollout.kv_cache_tokens={rollout.kv_cache_tokens} cannot hold one sequence: "
            f"data.max_prompt_len ({cfg.data.max_prompt_len}) + rollout.max_new_tokens "
            f"({rollout.max_new_tokens}) - 1 = {longest} positions")
    reason = paged_kv_refusal(cfg.model)
    if reason:
        raise ConfigError(f"rollout.kv_cache_tokens sizes the paged KV cache, which cannot "
                          f"decode {reason}: such a model decodes on rollout.kv_cache=columns; "
                          "unset rollout.kv_cache_tokens")


def check_supervised(cfg: Config) -> None:
    """The batch settings of the supervised stages (``sft``, ``rm``, ``dpo``,
    ``distill``) that contradict each other."""
    train = cfg.train
    if not isinstance(train.max_tokens_per_micro_batch, int):  # null, or auto (None there)
        return
    if cfg.data.packing:
        raise ConfigError("data.packing (rows of data.max_seq_len with a block-diagonal mask) "
                          "and train.max_tokens_per_micro_batch (packed micro-batches of "
                          "whole samples) both pack: choose one")


def check_roles(cfg: Config, written: Written, used: tuple[str, ...], stage: str) -> None:
    """A ``roles.<name>`` block that ``stage`` does not read is an error (it would do
    nothing), as is an optimizer on a frozen role or, for the roles that only fill the
    cache of dpo and distill (reference, teacher), an offload level."""
    for name in ROLES:
        if name not in used and written.fields(f"roles.{name}"):
            raise ConfigError(f"{_role_block(name, written)} is configured but {stage} has "
                              f"no {name} role: remove roles.{name}")
    for name in used:
        if name in ("actor", "critic"):
            continue
        own = getattr(cfg.roles, name)
        if own.optimizer is not None:
            raise ConfigError(f"roles.{name}.optimizer is set, but the {name} role is frozen")
        if stage in ("dpo", "distill") and own.offload is not None:
            raise ConfigError(f"roles.{name}.offload is set, but the {name} role only fills "
                              "the cache and is released before training: remove it")


def _role_block(name: str, written: Written) -> str:
    """``roles.<name>``, or the alias that wrote it (``ppo.reward_checkpoint``)."""
    keys = [f"roles.{name}.{field}" for field in sorted(written.fields(f"roles.{name}"))]
    aliases = [written.spelling(key) for key in keys if written.spelling(key) != key]
    return aliases[0] if aliases and len(aliases) == len(keys) else f"roles.{name}"


def check_placement(cfg: Config, job_world: int) -> int:
    """The training processes of a job of ``job_world`` (``rollout.placement.mode=split``: all
    but the last ``rollout.placement.ranks``), refused before any work when there are none."""
    if cfg.rollout.placement.mode != "split":
        return job_world
    r = cfg.rollout.placement.ranks
    if job_world - r < 1:
        raise ConfigError(
            f"rollout.placement.mode=split with rollout.placement.ranks={r} leaves no "
            f"training process in a "
            f"job of {job_world}: launch at least {r + 1} processes (torchrun "
            f"--nproc-per-node={r + 1}, or launch.nodes x launch.tasks_per_node)")
    return job_world - r


def check_launch(cfg: Config) -> int:
    """The Slurm job (``launch``) holds whole copies of every role's layout and of the
    rollout layout, TP within a node; returns the job's number of processes."""
    launch = cfg.launch
    job = launch.nodes * launch.tasks_per_node
    world = check_placement(cfg, job)  # the training processes
    for where, layout in _role_layouts(cfg).items():
        tp, pp, ranks = layout.tp, layout.pp, layout.model_parallel * layout.cp
        if world % ranks:
            sizes = f"TP x PP x CP = {tp} x {pp} x {layout.cp}" if layout.cp > 1 \
                else f"TP x PP = {tp} x {pp}"
            raise ConfigError(
                f"the layout {where}: {sizes} = {ranks} processes does not fit "
                f"{launch.nodes} node(s) x {launch.tasks_per_node} task(s) = {world}: use a "
                f"multiple of {ranks} processes (launch.nodes / launch.tasks_per_node)")
        if tp > launch.tasks_per_node:
            raise ConfigError(f"{where}: TP={tp} spans nodes (launch.tasks_per_node="
                              f"{launch.tasks_per_node}); keep TP within a node")
    if world % cfg.rollout.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} "
                          f"does not divide the {world} training processes of the job")
    if launch.gpus_per_node and launch.tasks_per_node > launch.gpus_per_node:
        raise ConfigError(f"launch.tasks_per_node={launch.tasks_per_node} exceeds "
                          f"launch.gpus_per_node={launch.gpus_per_node} (one task per GPU)")
    return job


def _role_layouts(cfg: Config) -> dict[str, Layout]:
    """The training layout and that of every role block that sets its own."""
    actor = cfg.roles.actor.parallel
    base = actor.over(cfg.parallel.layout)
    out = {"parallel" if actor == type(actor)() else "roles.actor.parallel": base}
    for name in ("critic", "reference", "reward"):
        own = getattr(cfg.roles, name).parallel
        if own != type(own)():
            out[f"roles.{name}.parallel"] = own.over(base)
    return out
