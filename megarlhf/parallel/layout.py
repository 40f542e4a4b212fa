"""Layouts placed on the ranks: one role's TP x PP (x VPP) x DP split of the world, with
its own megatron process groups built from ``HyperCommGrid``.

Every role (actor, critic, reference, reward model, the rollout's inference model) gets a
:class:`RankLayout` from :func:`build_layout` and hands its ``pg_collection`` to the
model, DDP and the optimizer, and itself to the pipeline schedule. Nothing reads megatron's
global ``parallel_state``. Groups are cached by shape: roles with the same TP x PP share
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megarlhf.algos.experience import exact_div
from megarlhf.config import Layout
from megarlhf.data.packing import balance
from megarlhf.parallel.watchdog import group_timeout


@dataclass(frozen=True)
class RankLayout:
    """A :class:`~megarlhf.config.Layout` placed on this rank: its coordinates and the
    process groups of models built in it (``pg_collection``: megatron's
    ``ProcessGroupCollection``). Sizes are the layout's; the data-parallel size and the
    coordinates follow from it (``Layout.dp``, ``Layout.coordinates``)."""

    layout: Layout
    world_size: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    pg_collection: object
    cp_rank: int = 0

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def vpp(self) -> int | None:
        return self.layout.vpp

    @property
    def dp(self) -> int:
        return self.layout.dp(self.world_size)

    # This rank's share of a global batch, the three ways there are:
    def strided_share(self, n: int) -> list[int]:
        """Items dp_rank, dp_rank + dp, ... of ``n``: every item once, the shares within
        one item of each other (rollouts, evaluation, scoring: no exact division)."""
        return list(range(self.dp_rank, n, self.dp))

    def run_share(self, n: int) -> range:
        """This rank's run of ``n`` items cut into dp contiguous runs (:func:`run_of`):
        every item once, the shares within one item of each other, neighbours together
        (rollouts: a GRPO group's k samples on one replica, which prefills its prompt once)."""
        return run_of(n, self.dp, self.dp_rank)

    def block_share(self, n: int, what: str) -> range:
        """The dp_rank-th of dp equal contiguous blocks of ``n`` items (a training batch:
        ``n`` must divide evenly, else a ConfigError naming ``what``)."""
        per_rank = exact_div(n, self.dp, what, "the data-parallel size")
        return range(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)

    def balanced_share(self, lengths: list[int]) -> list[int]:
        """This rank's indices of samples of ``lengths`` tokens, the shares' token counts
        as even as :func:`megarlhf.data.packing.balance` makes them (packed batches)."""
        return balance(lengths, self.dp)[self.dp_rank]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def tp_group(self):
        return self.pg_collection.tp

    @property
    def dp_group(self):
        return self.pg_collection.dp

    @property
    def pp_group(self):
        return self.pg_collection.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def cp_group(self):
        return self.pg_collection.cp

    @property
    def writes_results(self) -> bool:
        """The one rank per data-parallel replica that holds a pass's outputs: the last
        pipeline stage's TP and CP rank 0 (TP and CP ranks hold copies)."""
        return self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0

    def describe(self) -> str:
        return self.layout.describe(self.world_size)


_GROUPS: dict[tuple[int, ...], object] = {}


def _groups(layout: Layout, world: int):
    """The ``ProcessGroupCollection`` of a TP x PP (x EP x ETP) layout; created once per
    shape. Every rank must ask for the same shapes in the same order (group creation is
    collective). Experts have a grid of their own over the same ranks, megatron's
    ``tp-ep-dp-pp`` with ETP and EP: its groups are the collection's ``ep``, ``expt_tp``,
    ``expt_dp``, ``tp_ep`` and ``tp_ep_pp`` (for a dense layout without CP, the dense
    grid's; the CP ranks hold copies of every expert, so they are the experts' replicas)."""
    tp, pp, ep, etp, cp = layout.tp, layout.pp, layout.ep, layout.expert_tp, layout.cp
    key = (tp, pp, ep, etp, cp, world)
    if key in _GROUPS:
        return _GROUPS[key]
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.parallel_state import (
        default_embedding_ranks, default_position_embedding_ranks)
    from megatron.core.process_groups_config import ProcessGroupCollection

    dp = layout.dp(world)
    timeout = group_timeout()  # parallel.timeout_minutes: torch's own default otherwise
    grid = HyperCommGrid([tp, cp, 1, dp, pp], ["tp", "cp", "ep", "dp", "pp"])
    g = {name: grid.create_pg(name, timeout=timeout) for name in ("tp", "cp", "ep", "dp", "pp")}
    pp_ranks = dist.get_process_group_ranks(g["pp"])
    # Word embeddings live on the first and last stage (tied weights are kept in sync
    # over this group); learned positions on the first. Group creation is collective:
    # every rank creates every group and keeps those it belongs to (None elsewhere, as
    # megatron's parallel_state does).
    embd = pos_embd = None
    rank = dist.get_rank()
    for ranks in _all_pp_groups(tp, dp, pp, cp):
        embd_ranks = default_embedding_ranks(ranks)
        pos_ranks = default_position_embedding_ranks(ranks)
        e, p = (dist.new_group(embd_ranks, timeout=timeout),
                dist.new_group(pos_ranks, timeout=timeout))
        if rank in embd_ranks:
            embd = e
        if rank in pos_ranks:
            pos_embd = p
    assert pp_ranks == next(r for r in _all_pp_groups(tp, dp, pp, cp) if rank in r), \
        "HyperCommGrid's rank order is not tp-cp-ep-dp-pp"
    dp_cp = grid.create_pg(["cp", "dp"], timeout=timeout)
    # the ranks holding different parts of the weights (not CP: its ranks hold copies)
    mp = grid.create_pg(["tp", "ep", "pp"], timeout=timeout)
    if ep == 1 and etp == tp and cp == 1:  # the experts' grid is the dense one
        experts = {"ep": g["ep"], "expt_tp": g["tp"], "expt_dp": g["dp"],
                   "tp_ep": grid.create_pg(["tp", "ep"], timeout=timeout), "tp_ep_pp": mp}
    else:
        egrid = HyperCommGrid([etp, ep, layout.expert_dp(world), pp], ["tp", "ep", "dp", "pp"])
        e = {name: egrid.create_pg(name, timeout=timeout) for name in ("tp", "ep", "dp")}
        experts = {"ep": e["ep"], "expt_tp": e["tp"], "expt_dp": e["dp"],
                   "tp_ep": egrid.create_pg(["tp", "ep"], timeout=timeout),
                   "tp_ep_pp": egrid.create_pg(["tp", "ep", "pp"], timeout=timeout)}
    pgc = ProcessGroupCollection(
        tp=g["tp"], cp=g["cp"], pp=g["pp"], dp=g["dp"], embd=embd,
        pos_embd=pos_embd, tp_cp=grid.create_pg(["tp", "cp"], timeout=timeout),
        mp=mp, **experts,
        dp_cp=dp_cp, tp_dp_cp=grid.create_pg(["tp", "cp", "dp"], timeout=timeout), intra_dp_cp=dp_cp,
        intra_expt_dp=experts["expt_dp"],
        intra_dist_opt=grid.create_pg(["tp", "cp", "ep", "dp", "pp"], timeout=timeout))
    _GROUPS[key] = pgc
    return pgc


def _all_pp_groups(tp: int, dp: int, pp: int, cp: int = 1) -> list[list[int]]:
    """Ranks of every pipeline group, stage order (rank = tp + TP * (cp + CP * (dp + DP *
    pp)))."""
    inner = tp * cp
    return [[t + tp * c + inner * d + inner * dp * s for s in range(pp)]
            for d in range(dp) for c in range(cp) for t in range(tp)]


def build_layout(layout: Layout) -> RankLayout:
    """This rank's place in ``layout`` over the whole world (the rest of the world forms
    data-parallel replicas), with its groups. Sizes are validated before any process group
    exists (``config.check_model_layout``)."""
    world = dist.get_world_size()
    pgc = _groups(layout, world)
    tp_rank, dp_rank, pp_rank = layout.coordinates(dist.get_rank(), world)
    cp_rank = layout.cp_rank(dist.get_rank())
    assert (tp_rank, dp_rank, pp_rank, cp_rank) == (pgc.tp.rank(), pgc.dp.rank(),
                                                    pgc.pp.rank(), pgc.cp.rank()), \
        "HyperCommGrid's groups do not follow Layout.coordinates"
    return RankLayout(layout=layout, world_size=world, tp_rank=tp_rank, dp_rank=dp_rank,
                      pp_rank=pp_rank, pg_collection=pgc, cp_rank=cp_rank)


def reset_layouts() -> None:
    """Forget cached groups (after the default process group is destroyed)."""
    _GROUPS.clear()


def run_of(n: int, parts: int, part: int) -> range:
    """Run ``part`` of ``n`` items cut into ``parts`` contiguous runs, the first ``n % parts``
    one item longer."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return range(start, start + base + (part < extra))
