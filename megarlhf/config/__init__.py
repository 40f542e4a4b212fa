"""Typed configuration: the dataclass tree, YAML loading and layout validation."""

from megarlhf.config.layout import Layout
from megarlhf.config.loader import (
    ConfigError, config_from_dict, dump_config, explicit_fields, load_config, overlay,
    parse_overrides, section_from_dict, written_fields)
from megarlhf.config.ppo_rules import check_ppo
from megarlhf.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    FP8Config,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PPOConfig,
    RolloutConfig,
    RoleConfig,
    RoleParallelConfig,
    RolesConfig,
    RunConfig,
    TokenizerConfig,
    TrainConfig,
    check_model_layout,
    check_precision,
    check_rollout_layout,
    padded_vocab_size,
    validate_layout,
)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "Layout", "DataConfig", "FP8Config", "LoggingConfig",
    "ModelConfig", "OptimizerConfig", "config_from_dict", "PPOConfig", "ParallelConfig", "RolloutConfig",
    "RunConfig", "TokenizerConfig", "TrainConfig", "dump_config", "load_config", "padded_vocab_size",
    "parse_overrides", "validate_layout", "RoleConfig", "RoleParallelConfig", "RolesConfig",
    "check_model_layout", "check_precision", "check_rollout_layout", "explicit_fields",
    "overlay", "section_from_dict", "check_ppo", "written_fields",
]
