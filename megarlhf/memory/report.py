"""``megarlhf plan``'s report: a plan as a table, whether it fits, and the uniform
layouts, offload levels and recomputation that would when it does not."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from megarlhf.config import (
    Config, ConfigError, Layout, RecomputeConfig, Written, check_model_layout,
    padded_vocab_size)
from megarlhf.memory.estimates import GIB
from megarlhf.memory.plan import PHASES, Plan, plan_ppo
from megarlhf.roles.offload import OFFLOAD_LEVELS
from megarlhf.models.shapes import rank_chunks
from megarlhf.roles.spec import RoleSpec


def parse_bytes(text: str) -> int:
    """'80GiB', '80GB', '81920MiB', '85899345920' -> bytes (GB is 10^9, GiB 2^30)."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("kmgtib")
    unit = raw[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ConfigError(f"memory size {text!r}: write a positive number with a unit, "
                          "e.g. 80GiB or 141GB")
    return int(value * units[unit])


# ------------------------------------------------------------------ reporting

def _unit(worst: float) -> tuple[str, float]:
    return ("GiB", GIB) if worst >= GIB else ("MiB", 2.0**20)


def missing_checkpoints(cfg: Config) -> list[str]:
    """Role checkpoints the config names that are not on this machine: the plan sizes
    those roles from the config's model instead."""
    import os

    named = {f"roles.{name}.checkpoint": getattr(cfg.roles, name).checkpoint
             for name in ("actor", "reference", "reward", "critic")}
    return [f"{k}={v}" for k, v in named.items() if v and not os.path.exists(v)]


def model_params(spec: RoleSpec) -> int:
    """Global parameter count (TP=1, PP=1; the embedding at the padded vocabulary)."""
    (chunk,) = rank_chunks(spec.model, kind=spec.kind, padded_vocab=spec.padded_vocab,
                           layout=Layout(), pp_rank=0)
    return sum(p.numel for p in chunk)


def fits(plan: Plan, capacity: float, headroom: float) -> bool:
    return plan.worst()[0] <= capacity * (1.0 - headroom)


def format_plan(plan: Plan, capacity: float | None, headroom: float) -> str:
    lines = []
    lines.append(f"{'role':10s} {'model':34s} {'layout':22s} offload")
    for name, spec in plan.specs.items():
        if spec.adapters_off:
            lines.append(f"{name:10s} the actor's model with its LoRA adapters off (no "
                         "parameters of its own)")
            continue
        m = spec.model
        n = model_params(spec)
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        model = f"{m.arch} {m.num_layers}x{m.hidden_size} {spec.kind} {size} {m.params_dtype}"
        layout = spec.layout.describe(plan.world)
        opt = ""
        if spec.optimizer is not None:
            opt = " (distributed optimizer)" if spec.optimizer.use_distributed_optimizer \
                else " (plain optimizer)"
            if m.lora.enabled:
                trained = sum(p.numel for p in rank_chunks(
                    m, kind=spec.kind, padded_vocab=spec.padded_vocab, layout=Layout(),
                    pp_rank=0)[0] if not p.frozen)
                opt += f"; LoRA rank {m.lora.rank}: {trained / 1e6:.1f}M trained"
        lines.append(f"{name:10s} {model:34s} {layout:22s} {spec.offload}{opt}")
    replicas = (plan.rollout_ranks or plan.world) // plan.rollout_tp
    lines.append(f"inference  rollout TP={plan.rollout_tp}, {replicas} replica(s)"
                 + (f" on {plan.rollout_ranks} rollout rank(s) (placement split)"
                    if plan.rollout_ranks else ""))
    lines += [f"  {n}" for n in plan.notes]
    lines.append("")
    total, rank, phase = plan.worst()
    unit, scale = _unit(total)
    lines.append(f"{unit} per rank (the largest rank per phase); * = estimate, the rest is "
                 "exact")
    head = f"{'role':10s} {'part':12s}" + "".join(f"{p:>11s}" for p in PHASES)
    lines += [head, "-" * len(head)]
    per_phase = plan.phase_max()
    keys = sorted({k for parts in per_phase.values() for k in parts})
    for role, part in keys:
        star = "*" if part == "activations" else " "
        lines.append(f"{role:10s} {part + star:12s}" + "".join(
            f"{per_phase[p][(role, part)] / scale:11.2f}" if (role, part) in per_phase[p]
            else f"{'-':>11s}" for p in PHASES))
    worst_by_phase = {p: max(t[p] for t in plan.totals) for p in PHASES}
    lines.append(f"{'total':23s}" + "".join(f"{worst_by_phase[p] / scale:11.2f}"
                                             for p in PHASES))
    role, part, value = plan.largest_part(rank, phase)
    lines.append("")
    where = f"rank {rank} in the {phase} phase"
    lines.append(f"peak: {total / scale:.2f} {unit} on {where}; largest consumer there: "
                 f"{role} {part} ({value / scale:.2f} {unit})")
    if capacity is not None:
        limit = capacity * (1.0 - headroom)
        verdict = "fits" if total <= limit else "does NOT fit"
        cunit, cscale = _unit(capacity)
        lines.append(f"{verdict}: {capacity / cscale:.1f} {cunit} per GPU, {headroom:.0%} kept "
                     f"for the CUDA context and fragmentation -> {limit / cscale:.1f} {cunit} "
                     "usable")
    return "\n".join(lines)


def relayout(specs: dict[str, RoleSpec], cfg: Config, world: int, tp: int, pp: int,
             level: str, recompute: bool = False, cp: int = 1) -> dict[str, RoleSpec]:
    """``specs`` with every role at TP x PP x CP (its experts split as they were; sequence
    parallelism at TP > 1) and the trained roles offloading at ``level`` (and, with
    ``recompute``, recomputing every layer in the backward pass); ConfigError when a model
    does not split that way."""
    out = {}
    for name, spec in specs.items():
        layout = Layout(tp=tp, pp=pp, ep=spec.layout.ep, etp=spec.layout.etp, sp=tp > 1,
                        cp=cp)
        model = dataclasses.replace(spec.model, recompute=FULL_RECOMPUTE) \
            if recompute and spec.trained else spec.model
        check_model_layout(spec.where, model, layout, world, trained=spec.trained)
        padded = padded_vocab_size(spec.model.vocab_size,
                                   cfg.parallel.make_vocab_size_divisible_by, tp)
        out[name] = dataclasses.replace(spec, layout=layout, padded_vocab=padded, model=model,
                                        offload=level if spec.trained else spec.offload)
    return out


# the search's recomputation: every layer, its input kept (the most memory saved)
FULL_RECOMPUTE = RecomputeConfig(granularity="full", method="uniform", num_layers=1)


class Fit(NamedTuple):
    """One answer of the search: a uniform layout and the settings that make it fit."""

    tp: int
    pp: int
    rollout_tp: int
    recompute: bool  # full recomputation of the trained roles
    offload: str  # the trained roles' offload level
    micro_batch: int  # ppo.micro_batch_size
    peak: float  # bytes, the plan's largest rank and phase
    cp: int = 1  # context parallelism

    def overrides(self, cfg: Config, trained: list[str]) -> str:
        """The command-line overrides that select it."""
        text = (f"parallel.tensor_model_parallel_size={self.tp} "
                f"parallel.pipeline_model_parallel_size={self.pp} "
                f"rollout.tensor_parallel_size={self.rollout_tp}"
                + (" parallel.sequence_parallel=true" if self.tp > 1 else "")
                + (f" parallel.context_parallel_size={self.cp}" if self.cp > 1 else "")
                + "".join(f" roles.{name}.offload={self.offload}" for name in trained))
        if self.recompute:
            text += "".join(f" roles.{name}.model.recompute.granularity=full"
                            for name in trained)
        if self.micro_batch != cfg.ppo.micro_batch_size:
            text += f" ppo.micro_batch_size={self.micro_batch}"
        return text


def micro_batches(cfg: Config) -> list[int]:
    """``ppo.micro_batch_size`` and its halves down to 1: what the search may lower."""
    out, m = [], cfg.ppo.micro_batch_size
    while m >= 1:
        out.append(m)
        m //= 2
    return out


def layouts_that_fit(cfg: Config, specs: dict[str, RoleSpec], world: int, gpus_per_node: int,
                     capacity: float, headroom: float, limit: int = 6) -> list[Fit]:
    """Uniform layouts that fit, with sequence parallelism wherever TP > 1 (it only saves
    memory), TP x PP x CP (context parallelism where the models take it), cheapest first:
    TP within a node; fewest model-parallel ranks (TP x PP x CP) first, then
    without recomputation (it costs a forward pass of the layers), then the least
    offloading, then the largest micro-batch. At each layout the first that fits of:
    without and then with full recomputation, each at the offload levels from none up,
    each with the micro-batch from the configured one halved down to 1. The rollout takes the training TP, or a larger one
    within the node when nothing fits with it. Without recomputation a trained role keeps
    its own setting."""
    found = []
    for tp in (1, 2, 4, 8, 16):
        if tp > gpus_per_node or world % tp:
            continue
        for pp, cp in [(pp, cp) for pp in (1, 2, 4, 8, 16) for cp in (1, 2, 4, 8)]:
            if world % (tp * pp * cp):
                continue
            for rollout_tp in [r for r in (1, 2, 4, 8, 16)
                               if r >= tp and r <= gpus_per_node and world % r == 0]:
                fit = _first_fit(cfg, specs, world, tp, pp, rollout_tp,
                                 capacity * (1.0 - headroom), cp)
                if fit is not None:
                    found.append(fit)
                    break
    found.sort(key=lambda f: (f.tp * f.pp * f.cp, f.recompute,
                              OFFLOAD_LEVELS.index(f.offload), -f.micro_batch, f.rollout_tp,
                              f.cp))
    return found[:limit]


def _first_fit(cfg: Config, specs: dict[str, RoleSpec], world: int, tp: int, pp: int,
               rollout_tp: int, usable: float, cp: int = 1) -> Fit | None:
    """The first of (no recomputation, full recomputation) x the offload levels, least
    first, x the micro-batch from the configured one down, whose plan's peak is within
    ``usable`` bytes at this layout."""
    for recompute in (False, True):
        for level in OFFLOAD_LEVELS:
            try:
                relaid = relayout(specs, cfg, world, tp, pp, level, recompute, cp)
            except (ConfigError, ValueError):
                return None
            for micro in micro_batches(cfg):
                try:
                    smaller = dataclasses.replace(
                        cfg, ppo=dataclasses.replace(cfg.ppo, micro_batch_size=micro))
                    plan = plan_ppo(smaller, world, rollout_tp=rollout_tp, specs=relaid)
                except (ConfigError, ValueError):
                    continue
                peak = plan.worst()[0]
                if peak <= usable:
                    return Fit(tp, pp, rollout_tp, recompute, level, micro, peak, cp)
    return None


def explain(cfg: Config, world: int, capacity: float, gpus_per_node: int,
            headroom: float = 0.1, written: Written | None = None, search: bool = False
            ) -> tuple[bool, str]:
    """(fits, the plan's report with the layouts that would fit when it does not, or
    always with ``search``)."""
    plan = plan_ppo(cfg, world, written=written)
    ok = fits(plan, capacity, headroom)
    text = format_plan(plan, capacity, headroom)
    missing = missing_checkpoints(cfg)
    if missing:
        text += ("\nnot on this machine, sized from the config's model: "
                 + ", ".join(missing))
    if search or not ok:
        options = layouts_that_fit(cfg, plan.specs, world, gpus_per_node, capacity, headroom)
        if options:
            text += "\nlayouts that fit on these GPUs (every role):"
            trained = [name for name in ("actor", "critic") if name in plan.specs]
            for fit in options:
                unit, scale = _unit(fit.peak)
                text += f"\n  {fit.overrides(cfg, trained)}  (peak {fit.peak / scale:.1f} {unit})"
        else:
            text += ("\nno uniform layout of TP x PP on these GPUs fits: more GPUs, smaller "
                     "micro-batches or shorter sequences")
    return ok, text
