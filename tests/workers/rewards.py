"""Programmatic rewards for tests (importable with tests/workers on PYTHONPATH)."""


# As the CLI does, before megatron is imported: the speed-ups MEGARLHF_SPEEDUPS selects.
from megarlhf import speedups  # noqa: E402
speedups.install()

def nan_reward(prompt: str, response: str) -> float:
    return float("nan")
