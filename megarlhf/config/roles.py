"""Each role's checkpoint, model, layout, optimizer and offload: ``roles``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megarlhf.config.model import ModelConfig
from megarlhf.config.parallel import RoleParallelConfig
from megarlhf.config.training import OptimizerConfig


@dataclass(kw_only=True, frozen=True)
class RoleConfig:
    checkpoint: str | None = None
    """Checkpoint this role loads (a run's ``checkpoints`` folder, one checkpoint, or a
    converter's output folder). Aliases the loader turns into this field:
    ``ppo.sft_checkpoint`` (the actor's: an SFT run), ``ppo.reward_checkpoint`` (the reward
    model's; None needs rollout.rewards.fn), ``dpo.reference_checkpoint`` (the DPO
    reference; None: the policy's checkpoint.load), ``distill.teacher_checkpoint`` (the
    teacher's, any size)."""
    model: ModelConfig | None = None
    """Model of this role. By default the checkpoint's saved model; the fields written here
    replace it (e.g. ``params_dtype``). Shape fields must agree with the checkpoint."""
    parallel: RoleParallelConfig = field(default_factory=RoleParallelConfig)
    """This role's TP / PP / VPP (each defaults to the actor's layout)."""
    optimizer: OptimizerConfig | None = None
    """Trained roles only (actor, critic): the fields written here replace the top-level
    ``optimizer``'s (lr, schedule, use_distributed_optimizer, ...)."""
    offload: Literal["none", "optimizer", "optimizer+grads", "all"] | None = None
    """What leaves the accelerator (to pinned host memory) while it is not needed.
    Trained roles (actor, critic) during the rollout: none (default); optimizer (Adam
    state and fp32 master weights); optimizer+grads (also megatron's gradient buffers,
    dropped rather than copied); all (also the parameters, after the actor is resharded
    into the inference model; they return for the experience passes). Frozen roles
    (reference, reward): none or all (parameters between their scoring passes); null
    follows rollout.offload_frozen_models. ``megarlhf plan`` shows what each saves."""


@dataclass(kw_only=True, frozen=True)
class RolesConfig:
    """The four PPO roles, each with its own checkpoint, model and layout (all colocated
    on the same ranks, time-shared).

    - actor: ``roles.actor.checkpoint`` (alias ``ppo.sft_checkpoint``); model = that
      checkpoint's, with the fields written in the top-level ``model`` and
      ``roles.actor.model`` on top; layout = ``parallel`` with ``roles.actor.parallel`` on top; optimizer = ``optimizer``.
    - reference: ``roles.reference.checkpoint`` or the actor's checkpoint; model as the actor.
    - reward: ``roles.reward.checkpoint`` (alias ``ppo.reward_checkpoint``); model = its
      checkpoint's (another size or architecture just works).
    - critic: ``roles.critic.checkpoint`` or, by ``ppo.critic_init``, the reward model's
      checkpoint, the actor's, or none (random, the actor's shape); optimizer = ``optimizer``
      with lr = ``optimizer.critic_lr``, then ``roles.critic.optimizer`` on top.
    Every role's layout defaults to the actor's. The precision fields written in the
    top-level ``model`` (params_dtype, transformer_impl, fp8) apply to every role. Dropout
    is always off in PPO (it would make old and new log-probs different networks)."""

    actor: RoleConfig = field(default_factory=RoleConfig)
    """The trained policy."""
    critic: RoleConfig = field(default_factory=RoleConfig)
    """The trained value model (GAE only)."""
    reference: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reference policy of the KL penalty (PPO) or of DPO."""
    teacher: RoleConfig = field(default_factory=RoleConfig)
    """The frozen teacher of ``megarlhf distill`` (its checkpoint: roles.teacher.checkpoint,
    or its alias distill.teacher_checkpoint)."""
    reward: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reward model (unless ``rollout.rewards.fn`` is set)."""
    judge: RoleConfig = field(default_factory=RoleConfig)
    """The frozen judge of ``rollout.judge`` (a language model with the run's tokenizer,
    any size): it generates its verdicts at TP ``roles.judge.parallel.
    tensor_model_parallel_size`` (default rollout.tensor_parallel_size), the rest of the
    world data-parallel replicas."""
