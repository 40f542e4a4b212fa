"""Process start-up, parallel layouts and the CPU backend for megatron-core."""
