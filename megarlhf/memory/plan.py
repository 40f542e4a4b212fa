"""Memory per rank before anything is built: ``megarlhf plan``.

For every role, phase and rank the planner predicts what :mod:`memory.accounting` measures,
from the sizes of :mod:`megarlhf.memory.estimates` (exact parts and estimated
activations). Phases and what is resident in each mirror the PPO loop and
``RoleConfig.offload``. :mod:`megarlhf.memory.report` prints a plan and searches the
layouts that fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarlhf import speedups
from megarlhf.config import Config, Layout, Written, check_placement, paged_kv_refusal
from megarlhf.parallel.layout import run_of
from megarlhf.data.budgets import forward_budget, update_budget
from megarlhf.memory.estimates import (forward_bytes, kv_cache_bytes, packed_shape,
                                       prefill_bytes, static_bytes, train_activation_bytes)
from megarlhf.roles.offload import LEVEL_PARTS
from megarlhf.roles.spec import RoleSpec, batch_sizes, ppo_role_specs
from megarlhf.speedups import turn_kv

PHASES = ("rollout", "experience", "train", "save")


# ------------------------------------------------------------------ the plan

@dataclass
class Plan:
    """Bytes per rank: ``ranks[rank][phase][(role, part)]``; ``exact`` names the parts that
    equal measurement; totals follow the tracker's rules (activations of the trained
    roles peak one after the other; in the experience phase offloaded frozen roles are
    resident one at a time)."""

    world: int
    specs: dict[str, RoleSpec]
    rollout_tp: int
    ranks: list[dict[str, dict[tuple[str, str], float]]]
    totals: list[dict[str, float]]
    notes: list[str] = field(default_factory=list)
    # totals as the run's tracker measures them: without the forward-only estimates
    # (generation prefill, experience passes), which only a GPU allocator sees
    measurable: list[dict[str, float]] = field(default_factory=list)
    # rollout.placement.mode=split: the rollout ranks, after the ``world`` training ranks in
    # ``ranks`` and ``totals``
    rollout_ranks: int = 0

    def worst(self) -> tuple[float, int, str]:
        """(bytes, rank, phase) of the largest total."""
        return max((total, rank, phase) for rank, by_phase in enumerate(self.totals)
                   for phase, total in by_phase.items())

    def largest_part(self, rank: int, phase: str) -> tuple[str, str, float]:
        (role, part), value = max(self.ranks[rank][phase].items(), key=lambda kv: kv[1])
        return role, part, value

    def phase_max(self) -> dict[str, dict[tuple[str, str], float]]:
        """Per phase, each (role, part)'s largest value over ranks (what the run's
        memory/* metrics report)."""
        out: dict[str, dict[tuple[str, str], float]] = {p: {} for p in PHASES}
        for by_phase in self.ranks:
            for phase, parts in by_phase.items():
                for key, value in parts.items():
                    out[phase][key] = max(out[phase].get(key, 0.0), value)
        return out


def _resident(spec: RoleSpec, phase: str, part: str) -> bool:
    """Whether ``part`` of ``spec`` stays on the device throughout ``phase`` (offloaded
    frozen roles come on for their own pass in the experience phase, counted apart)."""
    level = spec.offload or "none"
    if not spec.trained:
        return level == "none"
    away = LEVEL_PARTS[level]
    if phase == "rollout":
        return part not in away
    if phase == "experience":
        return part == "params" or part not in away
    return True


def plan_ppo(cfg: Config, world: int, *, specs: dict[str, RoleSpec] | None = None,
             rollout_tp: int | None = None, prompt_len: int | None = None,
             response_len: int | None = None, written: Written | None = None) -> Plan:
    """Predict every rank's memory in every PPO phase. ``prompt_len`` / ``response_len``
    default to the longest the config allows (data.max_prompt_len, rollout.max_new_tokens);
    a measured run passes its batch's own to compare. ``written`` as in
    ``roles.spec.ppo_role_specs``. Under rollout.placement.mode=split the job's last
    rollout.placement.ranks processes only sample: they follow the training ranks."""
    place = cfg.rollout.placement
    split = place.mode == "split"
    if split:
        world = check_placement(cfg, world)
    specs = specs or ppo_role_specs(cfg, world, written=written, planning=True)
    ppo_plan = _PPOPlanner(cfg, world, specs, rollout_tp, prompt_len, response_len, split)
    rows = [ppo_plan.training_rank(rank) for rank in range(world)]
    if split:
        rows += [ppo_plan.rollout_rank(rank) for rank in range(place.ranks)]
    return Plan(world, specs, ppo_plan.inference.layout.tp, [r[0] for r in rows],
                [r[1] for r in rows], ppo_plan.notes(), [r[2] for r in rows],
                rollout_ranks=place.ranks if split else 0)


class _PPOPlanner:
    """One PPO config's shapes - sequence lengths, the inference model, the micro-batches
    of every pass - and each rank's bytes per phase from them: (parts by phase, totals,
    measurable totals)."""

    def __init__(self, cfg: Config, world: int, specs: dict[str, RoleSpec],
                 rollout_tp: int | None, prompt_len: int | None, response_len: int | None,
                 split: bool):
        ppo, r = cfg.ppo, cfg.rollout
        self.r, self.world, self.specs, self.split = r, world, specs, split
        self.P = prompt_len if prompt_len is not None else cfg.data.max_prompt_len
        self.T = response_len if response_len is not None else r.max_new_tokens
        self.S = self.P + self.T
        self.inference = dataclasses.replace(
            specs["actor"], name="inference",
            layout=Layout.inference(rollout_tp or r.tensor_parallel_size,
                                    specs["actor"].model), optimizer=None)
        self.ema = dataclasses.replace(specs["actor"], name="ema", optimizer=None) \
            if ppo.ema_decay else None
        self.samples = ppo.rollout_batch_size * ppo.group_size
        self.inf_dp = self.inference.layout.dp(world)
        self.sizes = batch_sizes(cfg, specs, world)  # the updates' micro-batches, per role
        self.budget = update_budget(cfg)  # packed updates (None: padded)
        self.micro_batch_size = ppo.micro_batch_size
        self.forward_budget = forward_budget(cfg)
        self.forward_rows = r.forward_micro_batch_size or ppo.micro_batch_size
        self.eval_prompts = ppo.num_eval_prompts if cfg.data.eval_path else 0
        self._static: dict = {}
        # multi-turn episodes: the replica's cache kept across turns (speedups.turn_kv), or
        # a turn's static batch, a conversation of up to data.max_seq_len tokens
        self.episode_columns = None if not r.episodic else \
            turn_kv.columns(cfg.data.max_seq_len) \
            if speedups.chosen("turn_kv") and r.environment.name \
            else cfg.data.max_seq_len

    def rollout_kv(self, rows: int) -> float:
        """A replica's KV cache for ``rows`` prompts: one static batch, or continuous
        batching's pool of blocks (inference.paged_kv), or its ``rollout.decode_slots`` rows
        of longer columns (``rollout.kv_cache=columns``, inference.continuous)."""
        slots, inf = self.r.decode_slots, self.inference
        if self.episode_columns is not None:
            return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=rows,
                                        seq=self.episode_columns))
        if slots is not None and slots < rows and self.r.kv_cache == "paged" \
                and paged_kv_refusal(inf.model) is None:
            # the pool of inference.paged_kv: whole blocks, by default every slot's longest
            bt, longest = self.r.kv_block_tokens, self.P + self.T - 1
            tokens = self.r.kv_cache_tokens
            blocks = -(-tokens // bt) if tokens is not None else slots * -(-longest // bt)
            return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=1, seq=blocks * bt))
        if slots is not None and slots < rows:
            return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=slots,
                                        seq=self.P + self.T * (-(-rows // slots) + 1)))
        return float(kv_cache_bytes(inf.model, tp=inf.layout.tp, batch=rows, seq=self.S))

    def static(self, spec: RoleSpec, rank: int) -> dict[str, int]:
        if spec.adapters_off:  # the actor's own model (a LoRA actor's reference)
            return {}
        _, d, s = spec.layout.coordinates(rank, self.world)
        # gradients are reduced, and the distributed optimizer shards, over DP x CP
        cp = spec.layout.cp
        shard = d * cp + spec.layout.cp_rank(rank)
        key = (spec.name, s, shard)
        if key not in self._static:
            self._static[key] = static_bytes(spec, spec.layout.dp(self.world) * cp, s, shard)
        return self._static[key]

    def training_rank(self, rank: int) -> tuple[dict, dict, dict]:
        r, specs, inference, P, S = self.r, self.specs, self.inference, self.P, self.S
        inf_replica = inference.layout.coordinates(rank, self.world)[1]
        # split: the training ranks generate for evaluation only
        rollout_rows = 0 if self.split else len(range(inf_replica, self.samples, self.inf_dp))
        eval_rows = len(range(inf_replica, self.eval_prompts, self.inf_dp))
        kv = self.rollout_kv(rollout_rows)
        by_phase: dict[str, dict[tuple[str, str], float]] = {p: {} for p in PHASES}
        total: dict[str, float] = {}
        for phase in PHASES:
            parts = by_phase[phase]
            for name, spec in specs.items():
                for part, value in self.static(spec, rank).items():
                    if _resident(spec, phase, part):
                        parts[(name, part)] = float(value)
            if phase == "rollout" or not r.release_inference_weights:
                parts[("inference", "params")] = float(self.static(inference, rank)["params"])
            if self.ema is not None:
                parts[("ema", "params")] = float(self.static(self.ema, rank)["params"])
            total[phase] = sum(parts.values())
        # the KV cache, and generation's prefill buffers (an estimate)
        by_phase["rollout"][("inference", "kv_cache")] = float(kv)
        total["rollout"] += kv
        measurable = dict(total)
        gen_rows = max(min(rollout_rows, r.decode_slots or rollout_rows), eval_rows)
        prefill = prefill_bytes(inference, batch=gen_rows, prompt=P)
        by_phase["rollout"][("inference", "activations")] = prefill
        eval_kv = kv_cache_bytes(inference.model, tp=inference.layout.tp, batch=eval_rows,
                                 seq=self.episode_columns or S)
        total["rollout"] += prefill + max(0, eval_kv - kv)
        # experience: offloaded frozen roles come on one at a time; one pass's buffers
        frozen_on = [float(self.static(spec, rank)["params"]) for spec in specs.values()
                     if not spec.trained and spec.offload == "all"]
        for name, spec in specs.items():
            if not spec.trained and spec.offload == "all":
                by_phase["experience"][(name, "params")] = \
                    float(self.static(spec, rank)["params"])
        passes = {}
        for name, spec in specs.items():
            _, _, s = spec.layout.coordinates(rank, self.world)
            if s == spec.layout.pp - 1:
                shape = packed_shape(self.forward_budget, P, self.T, spec.kind) \
                    if self.forward_budget else \
                    {"batch": self.forward_rows, "seq": S, "response": self.T}
                passes[name] = forward_bytes(spec, **shape)
                by_phase["experience"][(name, "activations")] = passes[name]
        measurable["experience"] += max(frozen_on, default=0.0)
        total["experience"] += max(frozen_on, default=0.0) + max(passes.values(), default=0.0)
        # train: each trained role's activations, one role at a time
        acts = {name: self.train_activations(spec, rank)
                for name, spec in specs.items() if spec.trained}
        for name, value in acts.items():
            by_phase["train"][(name, "activations")] = value
        total["train"] += max(acts.values(), default=0.0)
        measurable["train"] += max(acts.values(), default=0.0)
        return by_phase, total, measurable

    def train_activations(self, spec: RoleSpec, rank: int) -> float:
        """A trained role's activations in its updates on ``rank``: packed, the heaviest
        rank's tokens at most full samples; padded, its micro-batches of full samples."""
        _, _, s = spec.layout.coordinates(rank, self.world)
        sizes = self.sizes[spec.name]
        if self.budget:
            shape = packed_shape(self.budget, self.P, self.T, spec.kind)
            micro, micro_batches = 1, sizes.most_packed_micro_batches(self.S)
            seq, response, span = shape["seq"], shape["response"], shape["span"]
        else:
            micro, seq, response, span = self.micro_batch_size, self.S, self.T, None
            micro_batches = sizes.micro_batches_per_mini_batch
        return train_activation_bytes(spec, pp_rank=s, micro=micro,
                                      micro_batches=micro_batches, seq=seq,
                                      response=response, span=span)

    def rollout_rank(self, rank: int) -> tuple[dict, dict, dict]:
        """A rollout rank under split placement: the inference model, always resident, its
        KV cache and prefill buffers."""
        inference, ranks = self.inference, self.r.placement.ranks
        r_dp = ranks // inference.layout.tp
        replica = inference.layout.coordinates(rank, ranks)[1]
        rows = len(run_of(self.samples, r_dp, replica))
        params = float(static_bytes(inference, r_dp, 0, replica)["params"])
        by_phase = {p: {("inference", "params"): params} for p in PHASES}
        kv = self.rollout_kv(rows)
        by_phase["rollout"][("inference", "kv_cache")] = kv
        prefill = prefill_bytes(inference, batch=min(rows, self.r.decode_slots or rows),
                                prompt=self.P)
        by_phase["rollout"][("inference", "activations")] = prefill
        total = {p: params for p in PHASES}
        total["rollout"] += kv
        measurable = dict(total)
        total["rollout"] += prefill
        return by_phase, total, measurable

    def notes(self) -> list[str]:
        micro_note = "; ".join(
            f"{what}: " + (f"packed micro-batches of {b} tokens, each taken full, with the "
                           "most kept outputs its samples can have" if b
                           else f"micro-batch {rows}")
            for what, b, rows in (("updates", self.budget, self.micro_batch_size),
                                  ("experience passes", self.forward_budget,
                                   self.forward_rows)))
        inference, world = self.inference, self.world
        sampling = f"{self.inf_dp} inference replica(s) of TP={inference.layout.tp}"
        if self.split:
            ranks = self.r.placement.ranks
            sampling = (f"{ranks // inference.layout.tp} inference replica(s) of "
                        f"TP={inference.layout.tp} on the {ranks} rollout rank(s) "
                        f"{world}..{world + ranks - 1} (the training ranks keep a copy for "
                        "the weight sync and evaluation)")
        notes = [f"sequences of {self.P} prompt + {self.T} response tokens; {micro_note}; "
                 f"{self.samples} rollout samples over {sampling}"]
        if self.eval_prompts > self.samples and not self.split:
            notes.append(f"evaluation generates for {self.eval_prompts} prompts "
                         "(ppo.num_eval_prompts), more than a rollout: its KV cache is in "
                         "the rollout total")
        return notes
