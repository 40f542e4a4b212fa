"""A role's parallel layout as one value: what a config's ``parallel`` section writes
(``ParallelConfig.layout``, a role's ``roles.<name>.parallel`` on top of it:
``RoleParallelConfig.over``), carried unchanged to the process groups, the model, the
schedule and the memory plan.

Everything that follows from the sizes and the world size - the data-parallel size, a
rank's coordinates, the one-line description - is derived here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Tensor (``tp``), pipeline (``pp``, with ``vpp`` virtual stages per rank for the
    interleaved schedule) and expert parallelism (``ep`` expert-parallel ranks, ``etp``
    tensor-parallel ranks per expert, None for TP; room for mixture-of-experts models, 1 for dense
    ones), sequence parallelism (``sp``, at TP > 1) and context parallelism (``cp`` ranks
    split each sequence, ``parallel.context``). The rest of the world forms data-parallel
    replicas. Ranks are ordered TP fastest, then CP, DP, PP (megatron's ``tp-cp-ep-dp-pp``),
    so a TP group stays within a node."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    sp: bool = False
    cp: int = 1

    @classmethod
    def inference(cls, tp: int, model) -> "Layout":
        """The rollout's layout for ``model``: TP ``tp``, no PP, the rest of the world DP
        replicas; a mixture of experts with linear biases (gpt-oss) keeps each expert on
        one rank (ETP=1: megatron-core splits no expert's biases)."""
        return cls(tp=tp, etp=1 if model.moe.enabled and model.linear_bias else None)

    @property
    def expert_tp(self) -> int:
        """Tensor-parallel ranks per expert (``etp``; None: the layout's TP)."""
        return self.etp or self.tp

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model (TP x PP)."""
        return self.tp * self.pp

    def dp(self, world_size: int) -> int:
        """Data-parallel replicas on ``world_size`` ranks (the layout must divide it: the
        config's layout checks say so first, with the field names)."""
        ranks = self.model_parallel * self.cp
        if world_size % ranks:
            raise ValueError(f"{self.describe()} does not divide the world of {world_size} "
                             f"processes (TP x PP{' x CP' if self.cp > 1 else ''} = {ranks})")
        return world_size // ranks

    def expert_dp(self, world_size: int) -> int:
        """Data-parallel replicas of each expert: the world over ETP x EP x PP (megatron's
        expert grid ``tp-ep-dp-pp`` over the same ranks as the dense one)."""
        if world_size % (self.expert_tp * self.ep * self.pp):
            raise ValueError(f"{self.describe()} does not divide the world of {world_size} "
                             f"processes (ETP x EP x PP = {self.expert_tp * self.ep * self.pp})")
        return world_size // (self.expert_tp * self.ep * self.pp)

    def coordinates(self, rank: int, world_size: int) -> tuple[int, int, int]:
        """``rank``'s (tp_rank, dp_rank, pp_rank): rank = tp + TP * (cp + CP * (dp + DP *
        pp)); its CP rank is :meth:`cp_rank`."""
        dp = self.dp(world_size)
        inner = self.tp * self.cp
        return rank % self.tp, (rank // inner) % dp, rank // (inner * dp)

    def cp_rank(self, rank: int) -> int:
        """``rank``'s place in its context-parallel group."""
        return (rank // self.tp) % self.cp

    def describe(self, world_size: int | None = None) -> str:
        """``TP=2 PP=1 DP=2`` (DP when the world size is given), with VPP and EP when
        used."""
        text = f"TP={self.tp} PP={self.pp}"
        if world_size is not None:
            text += f" DP={self.dp(world_size)}"
        if self.sp:
            text += " SP"
        if self.cp > 1:
            text += f" CP={self.cp}"
        if self.vpp:
            text += f" VPP={self.vpp}"
        if self.ep > 1 or self.expert_tp != self.tp:
            text += f" EP={self.ep} ETP={self.expert_tp}"
        return text
