"""The root of the typed config tree: one section per component, each in its own module
beside this one, a docstring under every field.

YAML files in ``configs/`` set fields of this tree and nothing else; ``key.sub=value``
overrides on the command line do the same. Validation that concerns one component lives
in that component's ``__post_init__``; checks that span components (the parallel layout
against the model shape and the world size) live in :mod:`megarlhf.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarlhf.config.data import DataConfig, TokenizerConfig
from megarlhf.config.launch import LaunchConfig
from megarlhf.config.model import ModelConfig
from megarlhf.config.offline import CacheConfig, DistillConfig, DPOConfig
from megarlhf.config.parallel import ParallelConfig
from megarlhf.config.ppo import PPOConfig, RolloutConfig
from megarlhf.config.roles import RolesConfig
from megarlhf.config.run import CheckpointConfig, LoggingConfig, RunConfig
from megarlhf.config.training import OptimizerConfig, TrainConfig


@dataclass(kw_only=True, frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity and reproducibility."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Training layout."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimisation."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """SFT and reward-model training loops."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """PPO algorithm."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation and the inference layout."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Slurm resources for `megarlhf launch`."""
    roles: RolesConfig = field(default_factory=RolesConfig)
    """Per-role checkpoint, model, layout and optimizer for PPO (see RolesConfig)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """DPO (megarlhf dpo)."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Distillation (megarlhf distill)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The frozen-model cache of dpo and distill."""
