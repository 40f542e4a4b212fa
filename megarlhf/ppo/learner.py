"""PPO's update (stage 3 of an iteration): ``ppo_epochs`` passes of shuffled global
mini-batches of the experience, actor and critic each on its own data-parallel share,
stepping together; PPO-ptx's pretraining rows mixed into the actor's mini-batches."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from megarlhf import algos
from megarlhf.config import Config, ConfigError
from megarlhf.data.batching import pad_batch, prompt_response_batch
from megarlhf.data.budgets import update_budget
from megarlhf.data.packing import budget_groups, pack_prompt_response, pack_weighted
from megarlhf.data.datasets import tokenize_dataset
from megarlhf.models import moe
from megarlhf.engine.optimizer import check_runaway, forward_backward, step_together
from megarlhf.engine.steps import make_policy_step, make_value_step, ratio, reduce_logs
from megarlhf.parallel.gather import gather_objects
from megarlhf.rollout.scoring import sequence_lengths
from megarlhf.parallel.rank import print0
from megarlhf.parallel import watchdog
from megarlhf.algos.seeds import derive_seed


def _fields(mb: algos.Experience) -> dict:
    """What the policy and value losses read of a micro-batch's samples, (B, T) each."""
    out = {"response_mask": mb.response_mask_BT.float(), "policy_mask": mb.policy_mask_BT,
           "is_weights": mb.is_weights_BT, "old_logprobs": mb.old_logprobs_BT,
           "rollout_logprobs": mb.rollout_logprobs_BT, "ref_logprobs": mb.ref_logprobs_BT,
           "advantages": mb.advantages_BT, "old_values": mb.values_BT,
           "returns": mb.returns_BT}
    if mb.teacher_logprobs_BT is not None:  # ppo.teacher: the teacher's KL in the loss
        out["teacher_logprobs"] = mb.teacher_logprobs_BT
    return out


def experience_batches(exp: algos.Experience, micro: int, pad_id: int,
                       routing: bool = False) -> list[dict]:
    """Padded micro-batches of ``micro`` samples of ``exp``; ``routing``: with the expert
    choices to replay (the actor's, under ``rollout.routing_replay`` r2 or r3)."""
    out = []
    for mb in exp.micro_batches(micro):
        batch = prompt_response_batch(mb.prompt_tokens_BP, mb.prompt_mask_BP,
                                      mb.response_tokens_BT, mb.fed_BT, pad_id)
        batch.update(_fields(mb))
        if routing and mb.routing_BLSK is not None:  # the experts to replay (r2 / r3)
            batch["routing"] = mb.routing_BLSK
        out.append(batch)
    return out


def packed_experience_batches(mini: algos.Experience, layout, budget: int, pad_id: int,
                              routing: bool = False) -> list[dict]:
    """This data-parallel rank's packed micro-batches of the (global) mini-batch ``mini``:
    its share of balanced token counts (``data.packing.balance``), in micro-batches of at
    most ``budget`` tokens (``ppo.max_tokens_per_micro_batch``); ``routing`` as
    :func:`experience_batches` takes it."""
    lengths = sequence_lengths(mini)
    share = layout.balanced_share(lengths)
    out = []
    for group in budget_groups(share, lengths, budget, what="ppo.max_tokens_per_micro_batch"):
        mb = mini.select(group)
        batch = pack_prompt_response(mb.prompt_tokens_BP, mb.prompt_mask_BP,
                                     mb.response_tokens_BT, mb.fed_BT, kind="lm",
                                     pad_id=pad_id)
        batch.update(_fields(mb))
        if routing and mb.routing_BLSK is not None:  # the experts to replay (r2 / r3)
            batch["routing"] = moe.to_packed(mb.routing_BLSK, batch["source"])
        out.append(batch)
    return out


class PtxData:
    """PPO-ptx's pretraining side (InstructGPT): ``ppo.ptx_batch_size`` samples of
    ``data.ptx_path`` per actor mini-batch, taken in a fixed shuffled order from a cursor
    that is a function of the global mini-batch number (so a resume continues it)."""

    def __init__(self, cfg: Config, tokenizer, mini_batches_per_iteration: int):
        ppo = cfg.ppo
        ds = tokenize_dataset(cfg.data.ptx_path, "sft", cfg.data, tokenizer)
        self.examples = ds.examples()
        self.order = torch.randperm(len(self.examples), generator=torch.Generator()
                                    .manual_seed(derive_seed("ptx", cfg.run.seed))).tolist()
        self.batch_size = ppo.ptx_batch_size or ppo.mini_batch_size
        self.coef, self.micro, self.pad_id = ppo.ptx_coef, ppo.micro_batch_size, tokenizer.pad_id
        self.budget = update_budget(cfg)  # packed as the actor's updates
        self.per_iteration = mini_batches_per_iteration * ppo.ppo_epochs
        print0(f"[ppo] ptx: {ds.report()}; {self.batch_size} samples per actor mini-batch, "
               f"coefficient {self.coef:g}")

    def validate(self, dp_size: int) -> None:
        if self.budget is not None:  # shares balanced by tokens: a sample per rank
            if self.batch_size < dp_size:
                raise ConfigError(f"ppo.ptx_batch_size={self.batch_size} leaves a data-"
                                  f"parallel rank of the actor (DP={dp_size}) without rows")
            return
        per_rank = algos.exact_div(self.batch_size, dp_size, "ppo.ptx_batch_size",
                                   "the actor's data-parallel size")
        algos.exact_div(per_rank, self.micro, "ppo.ptx_batch_size per data-parallel rank",
                        "ppo.micro_batch_size")

    def batches(self, it: int, step: int, length: int, layout, policy_count: float
                ) -> list[dict]:
        """This rank's ptx micro-batches for mini-batch ``step`` of iteration ``it``, rows
        cut to the experience batch's ``length`` (one sequence length per pipeline
        schedule), scaled so the step's loss is PPO loss + ptx_coef x ptx NLL (the PPO
        loss is divided by ``policy_count`` over the whole mini-batch). Packed
        (``ppo.max_tokens_per_micro_batch``) as the PPO rows are: shares balanced by
        tokens, micro-batches of whole rows within the budget."""
        start = (it * self.per_iteration + step) * self.batch_size
        rows = [self.examples[self.order[(start + k) % len(self.order)]]
                for k in range(self.batch_size)]
        rows = [(toks[:length], weights[:length - 1] + [0]) if len(toks) > length
                else (toks, weights) for toks, weights in rows]
        tokens = sum(sum(w) for _, w in rows)
        scale = torch.tensor(self.coef * policy_count / max(tokens, 1))
        if self.budget is not None:
            lengths = [len(toks) for toks, _ in rows]
            out = []
            for group in budget_groups(layout.balanced_share(lengths), lengths,
                                       self.budget, what="ppo.max_tokens_per_micro_batch"):
                batch = pack_weighted([rows[i] for i in group], pad_id=self.pad_id)
                batch["ptx_loss_mask"] = batch.pop("loss_mask")
                batch["ptx_scale"] = scale
                out.append(batch)
            return out
        block = layout.block_share(len(rows), "ppo.ptx_batch_size")
        mine = rows[block.start:block.stop]
        out = []
        for i in range(0, len(mine), self.micro):
            batch = pad_batch(mine[i:i + self.micro], length, self.pad_id)
            out.append({"tokens": batch["tokens"], "position_ids": batch["position_ids"],
                        "ptx_loss_mask": batch["loss_mask"], "ptx_scale": scale})
        return out


def dp_share(exp: algos.Experience, layout) -> algos.Experience:
    """This data-parallel rank's contiguous share of a (global) mini-batch."""
    block = layout.block_share(len(exp), "ppo.mini_batch_size")
    return exp.rows(block.start, block.stop)


@dataclass
class PolicyMetrics:
    """The actor's side of an update: token means over its mini-batches (``loss``: the
    aggregated PPO loss; the optional ones only where the setting that makes them is
    on)."""

    loss: float
    pg_loss: float
    clipfrac: float
    approxkl: float
    entropy: float
    kl_loss: float | None = None  # ppo.kl.loss_coef
    teacher_loss: float | None = None  # ppo.teacher.kl_in=loss: the KL to the teacher
    behavior_weight: float | None = None  # ppo.decoupled_loss
    behavior_capped_frac: float | None = None
    ptx_loss: float | None = None  # ppo.ptx_coef


@dataclass
class ValueMetrics:
    """The critic's side of an update."""

    loss: float
    clipfrac: float
    explained_var: float | None  # None: the returns do not vary (it is undefined)


@dataclass
class UpdateMetrics:
    """What one :meth:`Learner.update` measured. :meth:`as_dict` gives the logged names
    (the only place they are spelled)."""

    skipped_steps: int
    padding_fraction: float  # of the token positions the training passes computed
    router: dict[str, float]  # the routers' losses, as megarlhf.models.moe names them
    policy: PolicyMetrics | None = None  # None: the critic's warm-up
    value: ValueMetrics | None = None  # None: no critic

    def as_dict(self) -> dict[str, float]:
        out = {"ppo/skipped_steps": self.skipped_steps,
               "perf/padding_fraction/train": self.padding_fraction, **self.router}
        p = self.policy
        if p is not None:
            out.update({"ppo/policy/loss": p.loss, "ppo/policy/pg_loss": p.pg_loss,
                        "ppo/policy/clipfrac": p.clipfrac, "ppo/policy/approxkl": p.approxkl,
                        "objective/entropy": p.entropy})
            optional = {"ppo/policy/kl_loss": p.kl_loss,
                        "ppo/policy/teacher_loss": p.teacher_loss,
                        "ppo/policy/behavior_weight": p.behavior_weight,
                        "ppo/policy/behavior_capped_frac": p.behavior_capped_frac,
                        "ppo/ptx/loss": p.ptx_loss}
            out.update({k: v for k, v in optional.items() if v is not None})
        if self.value is not None:
            out.update({"ppo/val/loss": self.value.loss,
                        "ppo/val/clipfrac": self.value.clipfrac})
            if self.value.explained_var is not None:
                out["ppo/val/explained_var"] = self.value.explained_var
        return out


class Learner:
    """Stage 3 of an iteration (PPO's update): ``ppo.ppo_epochs`` passes of shuffled global
    mini-batches; actor and critic each take their own data-parallel share and step
    together (or skip together); the EMA actor follows each step; with PPO-ptx each actor
    mini-batch also carries its pretraining micro-batches."""

    def __init__(self, cfg: Config, actor, critic, *, pad_id: int, ema=None,
                 ptx: PtxData | None = None):
        self.cfg, self.actor, self.critic = cfg, actor, critic
        self.pad_id, self.ema, self.ptx = pad_id, ema, ptx

    def update(self, exp: algos.Experience, it: int, critic_only: bool = False,
               meters: dict | None = None) -> UpdateMetrics:
        """One update on the experience of iteration ``it`` (``critic_only``: the critic's
        warm-up). ``meters`` (by role name) measure each role's activations during the
        first epoch: padded, every epoch runs the same micro-batch shapes (full prompt +
        response width), so its peak is the phase's; packed, every micro-batch is within
        the same token budget, but another epoch's packing may come closer to it. The
        saved-tensor hooks cost a Python call per saved tensor."""
        cfg, actor, critic, pad_id = self.cfg, self.actor, self.critic, self.pad_id
        ema, ptx = self.ema, self.ptx
        ppo = cfg.ppo
        P = exp.prompt_tokens_BP.shape[1]
        S = P + exp.response_tokens_BT.shape[1]
        policy_step = make_policy_step(prompt_len=P, tp_group=actor.layout.tp_group,
                                       true_vocab=actor.spec.model.vocab_size,
                                       temperature=cfg.rollout.temperature, ppo=ppo)
        value_step = make_value_step(prompt_len=P, cliprange_value=ppo.cliprange_value,
                                     agg=ppo.loss_agg, coef=ppo.value_loss_coef)
        learners = ([] if critic_only else [(actor, policy_step)]) \
            + ([(critic, value_step)] if critic is not None else [])
        logs: dict[str, list] = {role.spec.name: [] for role, _ in learners}
        gen = torch.Generator().manual_seed(derive_seed("update", cfg.run.seed, it))
        skipped = 0
        step = 0
        moe_sums: dict[str, dict[str, list[float]]] = {}
        budget = update_budget(cfg)  # None: padded micro-batches
        positions = [0, 0]  # token positions computed, and real, by this replica's passes
        for epoch in range(ppo.ppo_epochs):
            minis = list(exp.mini_batches(ppo.mini_batch_size, gen))
            for mini in minis:
                for role, fwd in learners:
                    if budget is not None:
                        batches = packed_experience_batches(mini, role.layout, budget, pad_id,
                                                            routing=role is actor)
                        real = sum(int(b["cu_seqlens"][b["grid"][0]]) for b in batches)
                    else:
                        share = dp_share(mini, role.layout)
                        batches = experience_batches(share, ppo.micro_batch_size, pad_id,
                                                     routing=role is actor)
                        real = sum(sequence_lengths(share))
                    if role.layout.writes_results:
                        positions[0] += sum(int(b["tokens"].numel()) for b in batches)
                        positions[1] += real
                    if ptx is not None and role is actor:
                        _, count = algos.aggregate_parts(torch.zeros_like(mini.policy_mask_BT),
                                                         mini.policy_mask_BT, ppo.loss_agg)
                        batches += ptx.batches(it, step, S, role.layout, float(count))
                    meter = (meters or {}).get(role.spec.name) if epoch == 0 else None
                    with meter or contextlib.nullcontext(), \
                            watchdog.phase(f"update of the {role.spec.name}"):
                        logs[role.spec.name] += forward_backward(
                            role.trained, fwd, batches,
                            seq_length=max(b["tokens"].shape[1] for b in batches),
                            micro_batch_size=batches[0]["tokens"].shape[0])
                    # the routers' losses of this role's passes (one tracker for all roles)
                    for key, value in moe.take_losses(role.spec.model, role.layout,
                                                      len(batches)).items():
                        moe_sums.setdefault(role.spec.name, {}).setdefault(key, []).append(value)
                if learners:
                    with watchdog.phase("optimizer step"):
                        ok, _ = step_together([role.trained for role, _ in learners])
                    skipped += not ok
                    for role, _ in learners:
                        check_runaway(role.trained, role.spec.name)
                if ema is not None and not critic_only:
                    ema.update(actor.parameters)
                step += 1
        computed, real = (sum(x) for x in zip(*gather_objects(positions)))
        router = {}
        for name, sums in moe_sums.items():  # the actor's as moe/*, a critic's moe/critic/*
            for key, values in sums.items():
                router[key if name == "actor" else key.replace("moe/", f"moe/{name}/")] = \
                    sum(values) / len(values)
        out = UpdateMetrics(skipped_steps=skipped,
                            padding_fraction=(computed - real) / computed if computed else 0.0,
                            router=router)
        if "actor" in logs:
            pol = reduce_logs(logs["actor"], actor.layout)
            out.policy = PolicyMetrics(
                loss=ratio(pol, "loss_sum", "loss_count"),
                pg_loss=ratio(pol, "pg_loss_sum", "loss_count"),
                clipfrac=ratio(pol, "clipfrac_sum", "tokens"),
                approxkl=ratio(pol, "approxkl_sum", "tokens"),
                entropy=ratio(pol, "entropy_sum", "tokens"))
            if ppo.kl.loss_coef:
                out.policy.kl_loss = ratio(pol, "kl_loss_sum", "tokens")
            if ppo.teacher.enabled and ppo.teacher.kl_in == "loss":
                out.policy.teacher_loss = ratio(pol, "teacher_loss_sum", "tokens")
            if ppo.decoupled_loss:
                out.policy.behavior_weight = ratio(
                    pol, "behavior_weight_sum", "tokens") / max(
                    1.0 - ratio(pol, "behavior_capped_sum", "tokens"), 1e-12)
                out.policy.behavior_capped_frac = ratio(pol, "behavior_capped_sum", "tokens")
            if ptx is not None:
                out.policy.ptx_loss = ratio(pol, "ptx_nll_sum", "ptx_tokens")
        if critic is not None:
            val = reduce_logs(logs["critic"], critic.layout)
            ev = algos.explained_variance(exp.values_BT, exp.returns_BT, exp.response_mask_BT)
            out.value = ValueMetrics(loss=ratio(val, "loss_sum", "loss_count"),
                                     clipfrac=ratio(val, "clipfrac_sum", "tokens"),
                                     explained_var=float(ev) if bool(ev.isfinite()) else None)
        return out
