"""Config -> one :class:`RoleSpec` per role: its checkpoint, model, layout and optimizer,
resolved and checked before any process group exists.

A role's model comes from its checkpoint's saved model config unless the config writes
fields on top; shape fields written in the config must agree with the checkpoint. Every
check names the role's config section, the field and both values.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from megarlhf.algos import BatchSizes
from megarlhf.config import (
    Config, ConfigError, Layout, LoRAConfig, ModelConfig, OptimizerConfig, Written,
    check_model_layout,
    check_ppo, check_precision, check_rollout_layout, overlay, padded_vocab_size,
    section_from_dict)
from megarlhf.data.budgets import update_budget
from megarlhf.engine.checkpoint import check_base, read_meta, resolve_checkpoint

# Fields that decide the shapes of the weights: a config may not contradict the checkpoint.
SHAPE_FIELDS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "head_dim", "qk_layernorm", "qk_layernorm_all_heads", "norm_placement",
                "ffn_hidden_size", "vocab_size", "tie_word_embeddings", "add_qkv_bias",
                "linear_bias", "attention_sinks")
# ``model.moe`` fields that define the network (the rest are training settings).
MOE_SHAPE_FIELDS = ("num_experts", "top_k", "ffn_hidden_size", "shared_expert_ffn_hidden_size",
                    "score_function", "normalize_top_k", "top_k_scaling_factor", "expert_bias",
                    "first_k_dense", "num_groups", "group_top_k", "router_fp32")
# ``model.mla`` fields (all define the network).
MLA_SHAPE_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim")
# Fields of the top-level ``model`` that apply to every role when written.
PRECISION_FIELDS = ("params_dtype", "transformer_impl", "fp8")


@dataclass(frozen=True)
class RoleSpec:
    """Everything needed to build one role at its layout."""

    name: str  # actor, critic, reference, reward; policy (SFT), reward (RM), model (score)
    kind: str  # "lm" (LM head) or "value" (scalar head)
    model: ModelConfig
    layout: Layout  # its parallel split (config -> process groups -> schedule)
    padded_vocab: int  # embedding rows: the vocabulary padded for every TP it meets
    checkpoint: str | None = None  # resolved checkpoint folder to initialise from
    checkpoint_role: str | None = None  # the role inside that checkpoint
    trunk_only: bool = False  # value model from an LM checkpoint: fresh scalar head
    optimizer: OptimizerConfig | None = None  # set for trained roles
    where: str = "model"  # config section, for messages
    saved_tokenizer: dict | None = None  # the checkpoint's tokenizer fingerprint
    head_affine: tuple[float, float] | None = None  # (gain, bias) folded into the scalar head
    # what leaves the device between phases (roles.offload levels); None: not resolved
    offload: str | None = None
    # the reference of a LoRA actor on its base checkpoint: the actor's own model with its
    # adapters off (no model of its own)
    adapters_off: bool = False

    @property
    def trained(self) -> bool:
        return self.optimizer is not None

    @property
    def optimizer_kind(self) -> str:
        """'distributed optimizer' or 'plain optimizer' (resolved per role from ``auto``)."""
        return ("distributed" if self.optimizer.use_distributed_optimizer else "plain") \
            + " optimizer"

    def describe(self) -> str:
        if self.adapters_off:
            return f"{self.name:9s} the actor's model with its LoRA adapters off"
        m = self.model
        src = (f"{self.checkpoint} [{self.checkpoint_role}]" + (" trunk only"
               if self.trunk_only else "")) if self.checkpoint else "random init"
        opt = (f"; lr {self.optimizer.lr:g}, {self.optimizer.lr_schedule}, "
               f"{self.optimizer_kind}") if self.optimizer else "; frozen"
        return (f"{self.name:9s} {self.kind:5s} {m.arch} {m.num_layers}x{m.hidden_size} "
                f"heads {m.num_attention_heads}/{m.query_groups} vocab {m.vocab_size} "
                f"{m.params_dtype}; {self.layout.describe()}; {src}{opt}")


@dataclass(frozen=True)
class SavedRole:
    """What a checkpoint says about one of its roles."""

    path: str  # the resolved checkpoint folder
    role: str
    kind: str | None
    model: ModelConfig | None
    tokenizer: dict | None  # fingerprint of the tokenizer it was trained with


def read_saved_role(path: str, preferred: tuple[str, ...], where: str) -> SavedRole:
    """The role to read from ``path``: the first of ``preferred`` it holds, else its only
    role. Errors name the config field that pointed here."""
    try:
        resolved = resolve_checkpoint(path)
        meta = read_meta(resolved)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{where}={path!r}: {err}") from None
    roles = list(meta.get("roles", {}))
    role = next((r for r in preferred if r in roles), None)
    if role is None:
        if len(roles) != 1:
            raise ConfigError(f"{where}={path!r} holds roles {roles}, none of "
                              f"{list(preferred)}: point at a checkpoint of that kind")
        role = roles[0]
    info = meta["roles"][role]
    if info.get("base"):  # LoRA adapters only: their base must be there, unchanged
        try:
            check_base(info["base"], resolved, role)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"{where}={path!r}: {err}") from None
    saved = info.get("model") or meta.get("config", {}).get("model")
    model = section_from_dict(ModelConfig, dict(saved), f"{where} (saved model)") \
        if saved else None
    return SavedRole(resolved, role, info.get("kind"), model, info.get("tokenizer"))


def _model_of(where: str, saved: SavedRole | None, base: ModelConfig,
              overrides: list[tuple[str, ModelConfig | None, tuple[str, ...] | None]],
              written: Written) -> ModelConfig:
    """``base`` (the checkpoint's saved model, or a config model for random init) with the
    written fields of each override (named by its dotted path) on top; shape fields may
    not contradict a checkpoint."""
    model = saved.model if saved is not None and saved.model is not None else base
    for name, override, only in overrides:
        if override is None:
            continue
        if saved is not None and saved.model is not None:
            for key in sorted(written.fields(name) & set(SHAPE_FIELDS)):
                if only is not None and key not in only:
                    continue
                want, have = getattr(override, key), getattr(saved.model, key)
                if want is not None and want != have:
                    raise ConfigError(
                        f"{where}: {name}.{key}={want!r} but the checkpoint {saved.path} "
                        f"(role '{saved.role}') has {key}={have!r}; remove the override or "
                        "load a checkpoint of that shape")
            for part, fields in (("moe", MOE_SHAPE_FIELDS), ("mla", MLA_SHAPE_FIELDS)):
                # (the precision fields of ``model`` a role takes: no moe, no mla)
                part_fields = written.fields(f"{name}.{part}") if only is None or part in only \
                    else frozenset()
                for key in sorted(part_fields & set(fields)):
                    want = getattr(getattr(override, part), key)
                    have = getattr(getattr(saved.model, part), key)
                    if want != have:
                        raise ConfigError(
                            f"{where}: {name}.{part}.{key}={want!r} but the checkpoint "
                            f"{saved.path} (role '{saved.role}') is {_shape_words(saved.model)}"
                            f" with {part}.{key}={have!r}; remove the override or load a "
                            "checkpoint of that shape")
        model = overlay(model, override, written, name, only)
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=base.vocab_size)
    return model


def _shape_words(model: ModelConfig) -> str:
    what = (f"a mixture of {model.moe.num_experts} experts" if model.moe.enabled
            else "a dense model")
    return what + (" with multi-latent attention" if model.mla.enabled else "")


def _check_kind(where: str, saved: SavedRole | None, kind: str, allow_trunk: bool) -> bool:
    """True when only the trunk loads (a value model initialised from an LM checkpoint)."""
    if saved is None or saved.kind is None or saved.kind == kind:
        return False
    if kind == "value" and saved.kind == "lm" and allow_trunk:
        return True
    what = {"lm": "a language model (LM head)", "value": "a value model (scalar head)"}
    raise ConfigError(f"{where}: the checkpoint {saved.path} (role '{saved.role}') is "
                      f"{what[saved.kind]}, but this role needs {what[kind]}")


def _spec(cfg: Config, *, name: str, kind: str, where: str, saved: SavedRole | None,
          model: ModelConfig, layout: Layout, world_size: int,
          optimizer: OptimizerConfig | None = None, allow_trunk: bool = False,
          vocab_tps: tuple[int, ...] = ()) -> RoleSpec:
    if model.vocab_size is None:
        raise ConfigError(f"{where}: the model's vocab_size is unknown: configure "
                          "tokenizer.path or set model.vocab_size")
    role_block = where.startswith("roles.")
    model_name = f"{where}.model" if role_block else "model"
    check_model_layout(f"{where}.parallel" if role_block else "parallel", model, layout,
                       world_size, model_name, trained=optimizer is not None)
    check_precision(model, model_name)
    if model.lora.init_from:  # read and checked now, before any work
        from megarlhf.models.lora import read_peft
        try:
            read_peft(model.lora.init_from, model)
        except ValueError as err:
            raise ConfigError(f"{model_name}.lora.init_from={model.lora.init_from!r}: "
                              f"{err}") from None
    trunk_only = _check_kind(where, saved, kind, allow_trunk)
    padded = padded_vocab_size(model.vocab_size, cfg.parallel.make_vocab_size_divisible_by,
                               math.lcm(layout.tp, *vocab_tps))
    if optimizer is not None and optimizer.use_distributed_optimizer == "auto":
        # sharding over one rank saves nothing and costs buffer copies; it shards over the
        # ranks that reduce gradients, DP x CP
        optimizer = dataclasses.replace(
            optimizer, use_distributed_optimizer=layout.dp(world_size) * layout.cp > 1)
    return RoleSpec(name=name, kind=kind, model=model, layout=layout,
                    padded_vocab=padded, checkpoint=saved.path if saved else None,
                    checkpoint_role=saved.role if saved else None, trunk_only=trunk_only,
                    optimizer=optimizer, where=where,
                    saved_tokenizer=saved.tokenizer if saved else None)


def _check_vocab(specs: dict[str, RoleSpec], tokenizer: dict | None) -> None:
    """Every role reads the same token ids: its vocabulary holds the configured tokenizer's
    and equals the actor's, and a checkpoint that recorded its tokenizer was trained with
    this one. ``tokenizer`` is ``data.tokenizer.fingerprint`` of the configured tokenizer."""
    actor = specs.get("actor") or next(iter(specs.values()))
    for spec in specs.values():
        v = spec.model.vocab_size
        if tokenizer is not None and v < tokenizer["vocab_size"]:
            raise ConfigError(f"{spec.where}: the model's vocab_size={v} is smaller than the "
                              f"tokenizer's vocabulary ({tokenizer['vocab_size']}): tokenizer "
                              "and checkpoint do not match")
        if spec is not actor and v != actor.model.vocab_size:
            raise ConfigError(f"{spec.where}: vocab_size={v} differs from the actor's "
                              f"({actor.model.vocab_size}): every role must share the actor's "
                              "tokenizer and vocabulary")
        saved = spec.saved_tokenizer
        if tokenizer is not None and saved is not None and saved != tokenizer:
            raise ConfigError(
                f"{spec.where}: the checkpoint {spec.checkpoint} was trained with another "
                f"tokenizer ({saved['vocab_size']} pieces, sha256 {saved['sha256']}) than "
                f"tokenizer.path ({tokenizer['vocab_size']} pieces, sha256 "
                f"{tokenizer['sha256']})")
        if spec is not actor and saved is not None and actor.saved_tokenizer is not None \
                and saved != actor.saved_tokenizer:
            raise ConfigError(f"{spec.where}: the checkpoint {spec.checkpoint} was trained "
                              f"with another tokenizer than the actor's ({actor.checkpoint})")


def batch_sizes(cfg: Config, specs: dict[str, RoleSpec], world_size: int
                ) -> dict[str, BatchSizes]:
    """The batch arithmetic of each trained role (each splits the mini-batches over its own
    data-parallel size), checked: what the run trains with and the planner counts."""
    ppo = cfg.ppo
    return {name: BatchSizes(ppo.rollout_batch_size, ppo.mini_batch_size,
                             ppo.micro_batch_size, spec.layout.dp(world_size), ppo.group_size,
                             update_budget(cfg)).validate()
            for name, spec in specs.items() if spec.trained}


def ppo_role_specs(cfg: Config, world_size: int, tokenizer: dict | None = None, *,
                   written: Written | None = None, planning: bool = False
                   ) -> dict[str, RoleSpec]:
    """The PPO roles (critic only for GAE; reward model unless ``rollout.rewards.fn``). The
    PPO settings are checked first (``config.check_ppo``). ``written``: what the config
    file and overrides wrote (``config.read_config``); for a config built in code, the
    fields that differ from their defaults. ``planning`` (``megarlhf plan``): a
    checkpoint that is not set or not there yet is a role of the config's model (``model``
    with ``roles.<name>.model`` on top), so a run can be sized before its checkpoints
    exist."""
    written = written or Written.differing(cfg)
    check_ppo(cfg, written, planning=planning)
    ppo, roles = cfg.ppo, cfg.roles

    def read(path, preferred, where):
        if planning and (path is None or not os.path.exists(path)):
            return None
        return read_saved_role(path, preferred, where)

    actor_ckpt = roles.actor.checkpoint
    reward_ckpt = roles.reward.checkpoint
    if planning and reward_ckpt is None and cfg.rollout.rewards.fn is None \
            and cfg.rollout.rewards.url is None and not cfg.rollout.episodic:
        reward_ckpt = ""  # a reward model of the config's model
    actor_layout = roles.actor.parallel.over(cfg.parallel.layout)
    precision = ("model", cfg.model, PRECISION_FIELDS)
    policy_overrides = [("model", cfg.model, None)]
    rollout_tp = cfg.rollout.tensor_parallel_size
    specs: dict[str, RoleSpec] = {}

    saved = actor_saved = read(actor_ckpt, ("policy", "actor"), "roles.actor.checkpoint")
    model = _model_of("roles.actor", saved, cfg.model,
                      policy_overrides + [("roles.actor.model", roles.actor.model, None)],
                      written)
    specs["actor"] = _spec(cfg, name="actor", kind="lm", where="roles.actor", saved=saved,
                           model=model, layout=actor_layout, world_size=world_size,
                           optimizer=overlay(cfg.optimizer, roles.actor.optimizer, written,
                                             "roles.actor.optimizer"),
                           vocab_tps=(rollout_tp,))
    check_rollout_layout(model, rollout_tp, world_size)
    if cfg.rollout.routing_replay != "none" and not model.moe.enabled:
        raise ConfigError(f"rollout.routing_replay={cfg.rollout.routing_replay} has no effect: "
                          "the actor is dense (its model.moe.num_experts is 0)")
    if cfg.rollout.routing_replay != "none" and not cfg.rollout.recompute_logprobs:
        raise ConfigError(f"rollout.routing_replay={cfg.rollout.routing_replay} replays "
                          "experts chosen before the updates in the actor's training-side "
                          "passes; with rollout.recompute_logprobs=false the updates are "
                          "the only such passes: set it true")

    ref_ckpt = roles.reference.checkpoint or actor_ckpt
    saved = read(ref_ckpt, ("policy", "actor", "reference"), "roles.reference.checkpoint")
    model = _model_of("roles.reference", saved, cfg.model,
                      policy_overrides + [("roles.reference.model", roles.reference.model,
                                           None)], written)
    specs["reference"] = base_reference(specs["actor"], _spec(
        cfg, name="reference", kind="lm", where="roles.reference", saved=saved,
        model=dataclasses.replace(model, lora=_saved_lora(saved)),
        layout=roles.reference.parallel.over(actor_layout, model.moe.enabled),
        world_size=world_size), actor_saved)

    def frozen(name: str, kind: str, saved: SavedRole | None) -> RoleSpec:
        """A frozen role of its own checkpoint (``saved``): its model with the precision
        fields of ``model`` and ``roles.<name>.model`` on top (any size), its layout
        ``roles.<name>.parallel`` on top of the actor's."""
        own = getattr(roles, name)
        model = _model_of(f"roles.{name}", saved, cfg.model,
                          [precision, (f"roles.{name}.model", own.model, None)], written)
        model = dataclasses.replace(model, lora=_saved_lora(saved))  # frozen
        return _spec(cfg, name=name, kind=kind, where=f"roles.{name}", saved=saved,
                     model=model, layout=own.parallel.over(actor_layout, model.moe.enabled),
                     world_size=world_size)

    reward_saved = None
    if reward_ckpt is not None:
        reward_saved = read(reward_ckpt, ("reward",), "roles.reward.checkpoint")
        specs["reward"] = frozen("reward", "value", reward_saved)

    if ppo.advantage_estimator == "gae":
        critic_ckpt = roles.critic.checkpoint
        if critic_ckpt is None:
            critic_ckpt = {"reward": reward_ckpt, "sft": actor_ckpt, "random": None}[
                ppo.critic_init]
        saved = read(critic_ckpt, ("critic", "reward", "policy", "actor"),
                     "roles.critic.checkpoint") if critic_ckpt else None
        base = dataclasses.replace(specs["actor"].model, lora=LoRAConfig())  # (the actor's)
        model = _model_of("roles.critic", saved, base,
                          [precision, ("roles.critic.model", roles.critic.model, None)],
                          written)
        critic_opt = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.critic_lr,
                                         min_lr=min(cfg.optimizer.min_lr,
                                                    cfg.optimizer.critic_lr))
        specs["critic"] = _spec(cfg, name="critic", kind="value", where="roles.critic",
                                saved=saved, model=model,
                                layout=roles.critic.parallel.over(actor_layout, model.moe.enabled),
                                world_size=world_size,
                                optimizer=overlay(critic_opt, roles.critic.optimizer, written,
                                                  "roles.critic.optimizer"),
                                allow_trunk=True)
        if saved is not None and saved.role == "reward":
            # Returns are built from the normalised score gain * raw + bias: a critic that
            # starts from the reward model predicts that scale from its first step.
            entry = read_meta(saved.path)["roles"]["reward"]
            specs["critic"] = dataclasses.replace(specs["critic"], head_affine=(
                float(entry.get("score_gain", 1.0)), float(entry.get("score_bias", 0.0))))
    if ppo.teacher.enabled:  # on-policy distillation: any size, the actor's vocabulary
        specs["teacher"] = frozen("teacher", "lm", read(
            roles.teacher.checkpoint, ("policy", "actor", "teacher"), "roles.teacher.checkpoint"))
    if cfg.rollout.judge.enabled:  # a judge: any size, the run's tokenizer, generating
        saved = read(roles.judge.checkpoint, ("policy", "actor", "judge"),
                     "roles.judge.checkpoint")
        model = _model_of("roles.judge", saved, cfg.model,
                          [precision, ("roles.judge.model", roles.judge.model, None)], written)
        model = dataclasses.replace(model, lora=_saved_lora(saved))
        tp = roles.judge.parallel.tensor_model_parallel_size or rollout_tp
        specs["judge"] = _spec(cfg, name="judge", kind="lm", where="roles.judge", saved=saved,
                               model=model, layout=Layout.inference(tp, model),
                               world_size=world_size)
    specs = {name: dataclasses.replace(spec, offload="none" if spec.adapters_off else
                                       _offload_of(cfg, name, spec.trained))
             for name, spec in specs.items()}
    _check_vocab(specs, tokenizer)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    for spec in specs.values():  # (the judge's prompts are checked as they come)
        if spec.name != "judge":
            check_positions(spec, longest, "data.max_prompt_len + rollout.max_new_tokens")
    # Dropout makes the ratio's numerator and denominator come from different networks.
    return {name: dataclasses.replace(spec, model=dataclasses.replace(
                spec.model, hidden_dropout=0.0, attention_dropout=0.0))
            for name, spec in specs.items()}


def _saved_lora(saved: SavedRole | None) -> LoRAConfig:
    """The adapters a checkpoint's model holds (none for random init)."""
    return saved.model.lora if saved is not None and saved.model is not None else LoRAConfig()


def base_reference(actor: RoleSpec, reference: RoleSpec,
                   actor_saved: SavedRole | None = None) -> RoleSpec:
    """The reference of a LoRA actor (or DPO policy) whose checkpoint holds no adapters:
    the actor starts as that checkpoint's model, so the reference - the same checkpoint,
    model and layout - is the actor with its adapters off, and has no model of its own.
    An actor whose adapters start from a PEFT folder (``model.lora.init_from``) starts
    as the base with that adapter, which its reference then holds too (frozen). Any other
    reference keeps its own model (with its checkpoint's adapters, if any).
    ``actor_saved``: the actor's checkpoint as read (read here when not given)."""
    if not actor.model.lora.enabled:
        return reference
    if actor_saved is None and actor.checkpoint:
        actor_saved = read_saved_role(actor.checkpoint, (actor.checkpoint_role,), actor.where)
    if _saved_lora(actor_saved).enabled:
        return reference
    same_model = (reference.checkpoint, reference.checkpoint_role, reference.model) == (
        actor.checkpoint, actor.checkpoint_role,
        dataclasses.replace(actor.model, lora=LoRAConfig()))
    if actor.model.lora.init_from:  # the actor starts from a PEFT adapter on the base:
        # the reference is that model, frozen
        return dataclasses.replace(reference, model=dataclasses.replace(
            reference.model, lora=actor.model.lora)) if same_model else reference
    if not same_model or reference.layout != actor.layout:
        return reference
    return dataclasses.replace(actor, name=reference.name, where=reference.where,
                               optimizer=None, adapters_off=True, offload="none")


def _offload_of(cfg: Config, name: str, trained: bool) -> str:
    """``roles.<name>.offload`` resolved: trained roles default to none, frozen ones to
    ``rollout.offload_frozen_models`` (``config.check_ppo`` allows them none or all)."""
    level = getattr(cfg.roles, name).offload
    if trained:
        return level or "none"
    if level is None:
        return "all" if cfg.rollout.offload_frozen_models else "none"
    return level


def check_positions(spec: RoleSpec, longest: int, what: str) -> None:
    """Sequences longer than the position table index past it (GPT-2) or run on positions
    RoPE was never trained at (Llama): refused before any work."""
    if longest > spec.model.max_position_embeddings:
        raise ConfigError(f"{spec.where}: {what} = {longest} tokens exceeds the model's "
                          f"max_position_embeddings={spec.model.max_position_embeddings}")


def single_role_spec(cfg: Config, *, name: str, kind: str, world_size: int, trained: bool,
                     checkpoint_role: str | None = None, tokenizer: dict | None = None,
                     written: Written | None = None) -> RoleSpec:
    """The one role of ``sft`` (policy), ``rm`` (reward) and ``score``: the top-level
    ``model`` and ``parallel``, initialised from ``checkpoint.load`` when set, the fields
    written in ``model`` on top (``written`` as in :func:`ppo_role_specs`)."""
    written = written or Written.differing(cfg)
    saved = None
    if cfg.checkpoint.load:
        preferred = (checkpoint_role,) if checkpoint_role else (name,)
        saved = read_saved_role(cfg.checkpoint.load, preferred, "checkpoint.load")
        if checkpoint_role and saved.role != checkpoint_role:
            raise ConfigError(f"checkpoint.load={cfg.checkpoint.load!r} has no role "
                              f"'{checkpoint_role}' (it holds '{saved.role}')")
    model = _model_of("model", saved, cfg.model, [("model", cfg.model, None)], written)
    spec = _spec(cfg, name=name, kind=kind, where="model", saved=saved, model=model,
                 layout=cfg.parallel.layout,
                 world_size=world_size, optimizer=cfg.optimizer if trained else None,
                 allow_trunk=trained, vocab_tps=(cfg.rollout.tensor_parallel_size,))
    _check_vocab({name: spec}, tokenizer)
    return spec


def frozen_role_spec(cfg: Config, *, name: str, checkpoint: str, where: str, base: RoleSpec,
                     world_size: int, tokenizer: dict | None = None,
                     written: Written | None = None) -> RoleSpec:
    """A frozen LM of ``dpo`` (the reference) or ``distill`` (the teacher): its checkpoint's
    model with ``roles.<name>.model`` on top and the precision fields of ``model``; its
    layout ``roles.<name>.parallel`` on top of ``parallel``. ``where`` names the field that
    gave the checkpoint. Its vocabulary must be the trained role's (``base``). The stage
    refuses the settings a frozen role does not read first (``config.check_roles``)."""
    written = written or Written.differing(cfg)
    own = getattr(cfg.roles, name)
    saved = read_saved_role(checkpoint, ("policy", "actor", name), where)
    model = _model_of(f"roles.{name}", saved, cfg.model,
                      [("model", cfg.model, PRECISION_FIELDS),
                       (f"roles.{name}.model", own.model, None)], written)
    layout = own.parallel.over(cfg.parallel.layout, model.moe.enabled)
    spec = _spec(cfg, name=name, kind="lm", where=f"roles.{name}", saved=saved, model=model,
                 layout=layout, world_size=world_size)
    _check_vocab({"actor": base, name: spec}, tokenizer)
    return spec
