"""Typed configuration: the dataclass tree (one module per section), YAML loading and the
checks that span settings."""

from megarlhf.config.data import DataConfig, TokenizerConfig
from megarlhf.config.layout import Layout
from megarlhf.config.loader import (
    ConfigError, config_from_dict, dump_config, explicit_fields, load_config, overlay,
    parse_overrides, section_from_dict, written_fields)
from megarlhf.config.model import FP8Config, ModelConfig, padded_vocab_size
from megarlhf.config.parallel import ParallelConfig, RoleParallelConfig
from megarlhf.config.ppo import PPOConfig, RolloutConfig
from megarlhf.config.roles import RoleConfig, RolesConfig
from megarlhf.config.rules import (
    check_model_layout, check_ppo, check_precision, check_rollout_layout, validate_layout)
from megarlhf.config.run import CheckpointConfig, LoggingConfig, RunConfig
from megarlhf.config.training import OptimizerConfig, TrainConfig
from megarlhf.config.tree import Config

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "Layout", "DataConfig", "FP8Config", "LoggingConfig",
    "ModelConfig", "OptimizerConfig", "config_from_dict", "PPOConfig", "ParallelConfig", "RolloutConfig",
    "RunConfig", "TokenizerConfig", "TrainConfig", "dump_config", "load_config", "padded_vocab_size",
    "parse_overrides", "validate_layout", "RoleConfig", "RoleParallelConfig", "RolesConfig",
    "check_model_layout", "check_precision", "check_rollout_layout", "explicit_fields",
    "overlay", "section_from_dict", "check_ppo", "written_fields",
]
