"""What the rollout calls at its phase boundaries (``ppo.session.PhaseHooks`` is the one
implementation: the trained roles' offload and the memory accounting)."""

from __future__ import annotations

from typing import Protocol


class RolloutHooks(Protocol):
    def before_generate(self) -> None:
        """Before sampling: the trained roles' state may leave the device."""

    def after_generate(self, kv_cache_bytes: int) -> None:
        """After sampling, with the bytes the KV cache held (0 where another process
        sampled)."""

    def during_pass(self) -> None:
        """Inside each scoring pass (reference, reward, values), with its role resident."""
