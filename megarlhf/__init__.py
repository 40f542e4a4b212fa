"""megarlhf: RLHF (PPO and relatives) on megatron-core."""

__version__ = "0.1.0"
