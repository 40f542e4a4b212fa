"""Typed configuration: the dataclass tree (one module per section), YAML loading and the
checks that span settings."""

from megarlhf.config.data import DataConfig, TokenizerConfig
from megarlhf.config.layout import Layout
from megarlhf.config.loader import (
    ALIASES, ConfigError, Loaded, config_from_dict, dump_config, load_config, overlay,
    parse_overrides, read_config, section_from_dict)
from megarlhf.config.model import (FP8Config, LoRAConfig, MLAConfig, ModelConfig, MoEConfig,
                                   RecomputeConfig, RopeScalingConfig, padded_vocab_size)
from megarlhf.config.parallel import ParallelConfig, RoleParallelConfig
from megarlhf.config.ppo import (AgentConfig, CorrectionConfig, EnvironmentConfig, JudgeConfig,
                                 KLConfig, PlacementConfig, PPOConfig, RewardsConfig,
                                 RolloutConfig)
from megarlhf.config.roles import RoleConfig, RolesConfig
from megarlhf.config.rules import (
    check_launch, check_model_layout, check_placement, check_ppo, check_precision, check_roles,
    check_supervised, check_rollout_layout, check_section, paged_kv_refusal, validate_layout)
from megarlhf.config.run import CheckpointConfig, LoggingConfig, RunConfig
from megarlhf.config.training import OptimizerConfig, TrainConfig
from megarlhf.config.tree import Config
from megarlhf.config.written import Written

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "Layout", "DataConfig", "FP8Config", "LoggingConfig",
    "LoRAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "RopeScalingConfig", "OptimizerConfig", "config_from_dict", "PPOConfig", "ParallelConfig", "RolloutConfig",
    "RunConfig", "TokenizerConfig", "TrainConfig", "dump_config", "load_config", "padded_vocab_size",
    "parse_overrides", "validate_layout", "RoleConfig", "RoleParallelConfig", "RolesConfig",
    "check_model_layout", "check_placement", "check_precision", "check_rollout_layout", "overlay",
    "section_from_dict", "check_ppo", "check_roles", "check_supervised", "check_section", "check_launch", "ALIASES",
    "Loaded", "read_config", "Written", "AgentConfig", "CorrectionConfig", "EnvironmentConfig", "JudgeConfig", "KLConfig",
    "PlacementConfig", "RecomputeConfig", "RewardsConfig", "paged_kv_refusal",
]
