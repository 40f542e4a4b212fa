"""Programmatic rewards for tests (importable with tests/workers on PYTHONPATH)."""


def nan_reward(prompt: str, response: str) -> float:
    return float("nan")
