"""``megarlhf ppo``: the PPO iteration (docs/design.md).

Each iteration reads as numbered stages:
1. rollout (reshard the actor into the inference layout, sample) and 2. experience
(reference, reward, values, shaped rewards, advantages) - one ``ExperienceMaker.make`` call;
3. ``ppo_epochs`` of shuffled mini-batch updates of actor and critic, stepping together;
4. KL-controller update, EMA, metrics, samples, evaluation, checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import Config, ConfigError, Written
from megarlhf.data.batching import pad_batch, prompt_response_batch
from megarlhf.data.packing import balance, budget_groups, pack_prompt_response, pack_weighted
from megarlhf.data.datasets import episode_rows, tokenize_dataset
from megarlhf.data.tokenizer import fingerprint
from megarlhf.engine.checkpoint import LATEST_FILE, load_checkpoint, load_object, save_checkpoint
from megarlhf.memory.accounting import ActivationMeter, MemoryTracker, format_table
from megarlhf.engine.metrics import MetricsLogger
from megarlhf.models import moe
from megarlhf.roles.offload import TrainedOffloader
from megarlhf.engine.optimizer import check_runaway, forward_backward, step_together
from megarlhf.parallel.preemption import PreemptionGuard, mark_preempted
from megarlhf.roles.spec import ppo_role_specs
from megarlhf.roles.build import build_role
from megarlhf.engine.steps import make_policy_step, make_value_step, ratio, reduce_logs
from megarlhf.parallel import cpu_backend
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel import placement
from megarlhf.parallel.launch import init_distributed, read_dist_env
from megarlhf.parallel.placement import Split
from megarlhf.rollout.episodes import Episodes, episode_metrics
from megarlhf.rollout.experience import ExperienceMaker, Sampled
from megarlhf.inference.generate import SamplingParams, generate
from megarlhf.inference.reshard import (
    Resharder, build_inference_model, inference_layout, release_inference_weights)
from megarlhf.rollout.sampling import Sampler, decode_sample
from megarlhf.rollout.remote import RemoteRollout, serve
from megarlhf.rollout.schedule import Later, StaleSchedule, staleness_metrics
from megarlhf.rollout.scoring import RewardSource, Scorer, SequenceCache, sequence_lengths
from megarlhf.rewards.verifiers import gold_on_some_ranks, make_verifier
from megarlhf.parallel.rank import print0
from megarlhf.stages.common import (MetricBands, check_writable, explain_resume, progress,
                                    run_dir)
from megarlhf.parallel import watchdog


# ------------------------------------------------------------------ set-up

def _fields(mb: algos.Experience) -> dict:
    """What the policy and value losses read of a micro-batch's samples, (B, T) each."""
    return {"response_mask": mb.response_mask_BT.float(), "policy_mask": mb.policy_mask_BT,
            "is_weights": mb.is_weights_BT, "old_logprobs": mb.old_logprobs_BT,
            "rollout_logprobs": mb.rollout_logprobs_BT, "ref_logprobs": mb.ref_logprobs_BT,
            "advantages": mb.advantages_BT, "old_values": mb.values_BT,
            "returns": mb.returns_BT}


@cpu_backend.suspended()  # batch arithmetic: no megatron code
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


@cpu_backend.suspended()  # batch arithmetic: no megatron code
def packed_experience_batches(mini: algos.Experience, layout, budget: int, pad_id: int,
                              routing: bool = False) -> list[dict]:
    """This data-parallel rank's packed micro-batches of the (global) mini-batch ``mini``:
    its share of balanced token counts (``data.packing.balance``), in micro-batches of at
    most ``budget`` tokens (``ppo.max_tokens_per_micro_batch``); ``routing`` as
    :func:`experience_batches` takes it."""
    lengths = sequence_lengths(mini)
    share = balance(lengths, layout.dp)[layout.dp_rank]
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
                                    .manual_seed(cfg.run.seed + 31)).tolist()
        self.batch_size = ppo.ptx_batch_size or ppo.mini_batch_size
        self.coef, self.micro, self.pad_id = ppo.ptx_coef, ppo.micro_batch_size, tokenizer.pad_id
        self.budget = ppo.max_tokens_per_micro_batch  # packed as the actor's updates
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
            for group in budget_groups(balance(lengths, layout.dp)[layout.dp_rank], lengths,
                                       self.budget, what="ppo.max_tokens_per_micro_batch"):
                batch = pack_weighted([rows[i] for i in group], pad_id=self.pad_id)
                batch["ptx_loss_mask"] = batch.pop("loss_mask")
                batch["ptx_scale"] = scale
                out.append(batch)
            return out
        per_rank = len(rows) // layout.dp
        mine = rows[layout.dp_rank * per_rank:(layout.dp_rank + 1) * per_rank]
        out = []
        for i in range(0, len(mine), self.micro):
            batch = pad_batch(mine[i:i + self.micro], length, self.pad_id)
            out.append({"tokens": batch["tokens"], "position_ids": batch["position_ids"],
                        "ptx_loss_mask": batch["loss_mask"], "ptx_scale": scale})
        return out


class PhaseHooks:
    """What happens at the phase boundaries of an iteration: the trained roles' state
    leaves the device for the rollout and comes back (``roles.<name>.offload``, see
    ``roles.offload.TrainedOffloader``), and ``tracker`` (when set) records each phase's
    memory: rollout (after the offload, with the KV cache), experience (during every
    scoring pass, with that pass's frozen role resident), train (with each trained
    role's activation peak) and save."""

    def __init__(self, trained: dict, tracker: MemoryTracker | None):
        self.offloaders = {name: TrainedOffloader(role, role.spec.offload)
                           for name, role in trained.items()
                           if role.spec.offload not in (None, "none")}
        self.trained, self.tracker = trained, tracker
        self.meters: dict[str, ActivationMeter] = {}

    def before_generate(self) -> None:
        for off in self.offloaders.values():
            off.release(("optimizer", "grads", "params"))
        if self.tracker is not None:
            self.tracker.start_phase("rollout")

    def after_generate(self, kv_cache_bytes: int) -> None:
        if self.tracker is not None:
            self.tracker.snapshot("rollout", extra={("inference", "kv_cache"): kv_cache_bytes})
            self.tracker.end_phase("rollout")
            self.tracker.start_phase("experience")
        for off in self.offloaders.values():
            off.restore(("params",))

    def during_pass(self) -> None:
        if self.tracker is not None:
            self.tracker.snapshot("experience")

    def before_train(self) -> dict[str, ActivationMeter]:
        """Bring optimizer state and gradients back; returns the activation meters the
        update runs its roles under (empty without a tracker)."""
        for off in self.offloaders.values():
            off.restore(("optimizer", "grads", "params"))
        if self.tracker is None:
            return {}
        self.tracker.end_phase("experience")
        self.tracker.start_phase("train")
        self.meters = {name: ActivationMeter(exclude=role.parameters)
                       for name, role in self.trained.items()}
        return self.meters

    def after_train(self) -> None:
        if self.tracker is not None:
            self.tracker.snapshot("train", transient={(name, "activations"): m.peak
                                                      for name, m in self.meters.items()})
            self.tracker.end_phase("train")

    def before_save(self) -> None:
        if self.tracker is not None:
            self.tracker.start_phase("save")
            self.tracker.snapshot("save")


def describe_layouts(roles: dict) -> str:
    return "; ".join(f"{name} {role.layout.describe()}" for name, role in roles.items())


# ------------------------------------------------------------------ the loop

class PPOSession:
    """Everything one PPO run holds - the four roles, each at its own layout, the inference
    layout, the experience maker, the KL controller - built once; :meth:`iteration` runs
    stages 1-3 plus the KL update. ``run_ppo`` adds evaluation, logging and checkpoints;
    benchmarks step it directly."""

    def __init__(self, cfg: Config, tokenizer, written: Written | None = None,
                 split: Split | None = None):
        ppo, r = cfg.ppo, cfg.rollout
        world = read_dist_env().world_size
        self.tokenizer_fingerprint = fingerprint(tokenizer)
        self.specs = specs = ppo_role_specs(cfg, world, self.tokenizer_fingerprint,
                                            written=written)
        # Batch arithmetic per trained role (each splits mini-batches over its own DP).
        self.sizes = {name: algos.BatchSizes(ppo.rollout_batch_size, ppo.mini_batch_size,
                                             ppo.micro_batch_size, s.layout.dp(world),
                                             ppo.group_size,
                                             ppo.max_tokens_per_micro_batch).validate()
                      for name, s in specs.items() if s.trained}
        forward_budget = r.forward_max_tokens_per_micro_batch or ppo.max_tokens_per_micro_batch
        self.cfg, self.tokenizer = cfg, tokenizer
        # an environment's episodes start from data rows (its reset), else from prompts
        read = (lambda path: episode_rows(path, cfg.data)) if r.environment else \
            (lambda path: tokenize_dataset(path, "prompt", cfg.data, tokenizer))
        self.prompts = read(cfg.data.train_path)
        self.eval_prompts = read(cfg.data.eval_path) if cfg.data.eval_path else None
        for ds in (self.prompts, self.eval_prompts):
            if ds is not None:
                print0(f"[ppo] {ds.report()}")
        # a programmatic reward: a function in worker processes, or a reward server
        reward_fn = make_verifier(r, fn_path=r.reward_fn) if r.reward_fn else \
            make_verifier(r, url=r.reward_url) if r.reward_url else None
        self.ptx = PtxData(cfg, tokenizer, self.sizes["actor"].num_mini_batches) \
            if ppo.ptx_coef > 0 else None
        if self.ptx is not None:
            actor = specs["actor"]
            self.ptx.validate(actor.layout.dp(world))

        init_distributed(cfg)
        total_steps = ppo.num_iterations * ppo.ppo_epochs * self.sizes["actor"].num_mini_batches
        seed = cfg.run.seed
        self.actor = build_role(specs["actor"], seed=seed, total_steps=total_steps)
        self.critic = build_role(specs["critic"], seed=seed, total_steps=total_steps) \
            if "critic" in specs else None
        self.reference = build_role(specs["reference"], seed=seed)
        reward = RewardSource(fn=reward_fn, decode=tokenizer.decode,
                              role=build_role(specs["reward"], seed=seed)
                              if "reward" in specs else None)
        inf_layout = inference_layout(r.tensor_parallel_size)
        self.sampler = Sampler(cfg, self.actor, inf_layout,
                               build_inference_model(specs["actor"], inf_layout),
                               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                               release_inference=r.release_inference_weights,
                               end_ids=tokenizer.end_ids,
                               episodes=Episodes(cfg, tokenizer) if r.environment else None)
        self.scorer = Scorer(cfg, self.actor, self.reference, reward, self.critic,
                             pad_id=tokenizer.pad_id,
                             micro_batch_size=r.forward_micro_batch_size
                             or ppo.micro_batch_size, max_tokens=forward_budget,
                             ref_cache=SequenceCache(r.ref_cache_size)
                             if r.ref_cache_size else None)
        # rollout.placement=split: the rollout ranks sample, this world scores and trains
        self.remote = RemoteRollout(cfg, split, self.sampler) if split is not None else None
        self.maker = ExperienceMaker(cfg, self.sampler, self.scorer, remote=self.remote)
        self.rollouts = StaleSchedule(ppo.max_staleness, ppo.num_iterations,
                                      self.sample_batch, log=print0)
        self.kl_ctl = algos.make_kl_controller(ppo.kl_controller, ppo.init_kl_coef,
                                               ppo.kl_target, ppo.kl_horizon)
        # EMA of the actor (evaluation only): its own frozen role at the actor's layout, so
        # it is checkpointed, resumed, evaluated, scored and exported like any role.
        self.ema = self.ema_role = None
        if ppo.ema_decay:
            self.ema = algos.ParameterEMA(self.actor.parameters, ppo.ema_decay)
            self.ema_role = build_role(dataclasses.replace(specs["actor"], name="ema",
                                                           optimizer=None), seed=seed)
            self.ema_resharder = Resharder(self.ema_role.chunks, self.sampler.inference_model)
        self.trained = {"actor": self.actor}
        if self.critic is not None:
            self.trained["critic"] = self.critic
        self.tracker = MemoryTracker({
            "actor": self.actor, "critic": self.critic, "reference": self.reference,
            "reward": reward.role, "ema": self.ema_role,
            "inference": [self.sampler.inference_model]}) if cfg.logging.memory_metrics else None
        self.hooks = self.sampler.hooks = self.scorer.hooks = PhaseHooks(self.trained,
                                                                          self.tracker)
        built = {"actor": self.actor, "critic": self.critic, "reference": self.reference,
                 "reward": reward.role}
        self.layouts = describe_layouts({k: v for k, v in built.items() if v is not None})
        for spec in specs.values():
            print0(f"[ppo] {spec.describe()}")
        print0(f"[ppo] rollout TP={r.tensor_parallel_size} x {inf_layout.dp} replicas; "
               f"{self.sizes['actor'].describe()}; {len(self.prompts)} prompts")

    @property
    def roles(self) -> dict:
        """The checkpoint states of the trained roles and the EMA actor (with the tokenizer
        they were trained with)."""
        states = {name: role.state() for name, role in self.trained.items()}
        if self.ema_role is not None:
            states["ema"] = self.ema_role.state()
            states["ema"].extra.update(decay=self.ema.decay, num_updates=self.ema.num_updates)
        for state in states.values():
            state.extra["tokenizer"] = self.tokenizer_fingerprint
        return states

    def sync_ema(self) -> None:
        """Write the EMA averages into the EMA role (before it is saved or evaluated)."""
        if self.ema is not None:
            self.ema.copy_to(self.ema_role.parameters)

    def restore_ema(self, meta: dict) -> None:
        """After a resume: the averages from the EMA role the checkpoint restored."""
        if self.ema is None:
            return
        entry = meta["roles"]["ema"]  # load_checkpoint asked for it
        with torch.no_grad():
            for avg, p in zip(self.ema.shadow, self.ema_role.parameters):
                avg.copy_(p.detach().to(torch.float32))
        self.ema.num_updates = int(entry.get("num_updates", 0))

    def prompt_batch(self, it: int, round_: int = 0) -> list[list[int]]:
        """Iteration ``it``'s prompts (each ``group_size`` times); ``round_`` > 0: the extra
        prompts of dynamic sampling, a fixed function of (iteration, round)."""
        ppo = self.cfg.ppo
        return _prompt_batch(self.prompts.prompts, ppo.rollout_batch_size, ppo.group_size,
                             self.cfg.run.seed + 7919 * round_, it)

    def sample_batch(self, batch: int, version: int) -> Sampled | Later:
        """Batch ``batch``'s prompts sampled (and scored by the reward) by the actor as it
        is now, policy ``version`` (``rollout.schedule``); split, by the rollout ranks, in
        the background (:class:`~megarlhf.rollout.schedule.Later`)."""
        prompts = self.prompt_batch(batch)
        how = dict(seed=self.cfg.run.seed + batch, version=version,
                   refill=lambda round_: self.prompt_batch(batch, round_))
        if self.remote is None:
            return self.maker.sample(prompts, **how)
        pending = self.remote.submit(prompts, how["seed"], version)
        return Later(lambda: self.maker.sample(prompts, **how, sampled=pending.receive()))

    def iteration(self, it: int) -> tuple[dict, algos.Experience, object]:
        """One PPO iteration: (metrics, experience, generation)."""
        cfg, ppo = self.cfg, self.cfg.ppo
        t_iter = time.perf_counter()
        if self.tracker is not None:
            self.tracker.begin_iteration()
        # 1-2. rollout (batch it, sampled by version max(0, it - k): ppo.max_staleness)
        # and experience
        sampled = self.rollouts.take(it)
        exp, gen, metrics = self.maker.score(sampled, kl_coef=self.kl_ctl.value)
        metrics.update(staleness_metrics(exp.versions_BT, exp.response_mask_BT, it,
                                         ppo.max_staleness))
        # 3. PPO epochs over shuffled mini-batches
        t_train = time.perf_counter()
        train_critic_only = it < ppo.critic_warmup_iterations
        meters = self.hooks.before_train()
        metrics.update(_update(cfg, exp, self.actor, self.critic, self.tokenizer.pad_id, it,
                               train_critic_only, self.ema, self.ptx, meters))
        self.hooks.after_train()
        metrics["timing/train"] = time.perf_counter() - t_train
        if self.remote is not None:  # rollout.partial: the batch being sampled takes the
            self.remote.push(it + 1)  # new weights for its remaining tokens
        self.rollouts.settle()  # split: the batch the rollout ranks sampled meanwhile
        if self.remote is not None:
            metrics.update(self.remote.take_sync_metrics())
        if metrics["ppo/skipped_steps"]:
            print0(f"[ppo] iteration {it + 1}: {metrics['ppo/skipped_steps']} optimizer step(s) "
                   "skipped for non-finite gradients")
        # 4. KL controller
        self.kl_ctl.update(metrics["objective/kl"], ppo.rollout_batch_size * ppo.group_size)
        metrics["objective/kl_coef"] = self.kl_ctl.value
        metrics["timing/iteration"] = time.perf_counter() - t_iter
        tokens = exp.fed_BT.sum() + exp.prompt_mask_BP.sum()
        metrics["perf/tokens_per_s"] = float(tokens) / metrics["timing/iteration"]
        metrics["perf/samples_per_s"] = len(exp) / metrics["timing/iteration"]
        if self.tracker is not None:
            metrics.update(self.tracker.metrics())
        return metrics, exp, gen

    def close(self) -> None:
        self.scorer.restore_frozen_models()
        if self.sampler.episodes is not None:
            self.sampler.episodes.close()
        if self.remote is not None:
            self.remote.close()


def run_ppo(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    ppo = cfg.ppo
    gold_fn = make_verifier(cfg.rollout, fn_path=ppo.gold_reward_fn,
                            name="ppo.gold_reward_fn") if ppo.gold_reward_fn else None
    split = placement.start(cfg)  # rollout.placement=split: this process's part of the job
    if split is not None and not split.training:
        actor = ppo_role_specs(cfg, split.training_world, fingerprint(tokenizer),
                               written=written)["actor"]
        return {"batches_sampled": serve(cfg, tokenizer, split, actor)}
    check_writable(cfg)
    session = PPOSession(cfg, tokenizer, written, split)
    if split is not None:
        print0(f"[ppo] {split.describe()}")
    kl_ctl, cache = session.kl_ctl, session.scorer.ref_cache
    ckpt_dir = os.path.join(run_dir(cfg), "checkpoints")
    start = 0
    if cfg.checkpoint.resume and os.path.exists(os.path.join(ckpt_dir, LATEST_FILE)):
        explain_resume(cfg, ckpt_dir)
        meta = load_checkpoint(ckpt_dir, session.roles, layout=session.layouts)
        start = int(meta["trainer"]["iteration"])
        kl_ctl.load_state_dict(meta["trainer"]["kl_controller"])
        session.restore_ema(meta)
        try:
            saved_cache = load_object(ckpt_dir, "ref_cache")
        except ValueError as err:  # a cache: safe to start empty
            print0(f"[ppo] warning: {err}; the reference log-prob cache starts empty")
            saved_cache = None
        if cache is not None and saved_cache is not None:
            cache.load_state_dict(saved_cache)
        waiting, why = _waiting_batches(ckpt_dir)
        session.rollouts.load_state_dict(waiting, start=start, why=why)
        print0(f"[ppo] resumed {meta['tag']} at iteration {start}")
    logger = MetricsLogger(run_dir(cfg), tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume_step=start or None)
    evaluate_policy = _evaluator(cfg, session.sampler, session.eval_prompts, tokenizer, gold_fn)

    @watchdog.labelled("evaluation")
    def evaluate(step: int) -> dict:
        out = evaluate_policy(step)
        if session.ema is not None and session.eval_prompts is not None:
            session.sync_ema()  # the EMA actor, on the same prompts
            out.update(evaluate_policy(step, session.ema_resharder, "eval/ema/"))
        return out

    guard = PreemptionGuard()
    bar = progress(ppo.num_iterations, start, "ppo", cfg.logging.progress_bar)
    bands = MetricBands(cfg)
    if start == 0:
        first = evaluate(0)
        logger.log(0, first)
        bands.check(first, "the evaluation before training")
    result = {}
    for it in range(start, ppo.num_iterations):
        metrics, exp, gen = session.iteration(it)
        # 4. evaluation, metrics, samples, checkpoint
        done = it + 1
        if done % ppo.eval_interval == 0 or done == ppo.num_iterations:
            metrics.update(evaluate(done))
        logger.log(done, metrics)
        bands.check(metrics, f"iteration {done}")
        if cfg.logging.sample_table_interval and (it % cfg.logging.sample_table_interval == 0):
            _sample_table(gen, exp, tokenizer, logger, done, bar)
        bar.update(1)
        bar.set_postfix(score=f"{metrics['objective/score']:.3f}",
                        kl=f"{metrics['objective/kl']:.2f}",
                        gold=f"{metrics.get('eval/gold_score', float('nan')):.2f}")
        # (split: the rollout ranks report a signal with the batches they send)
        preempted = done < ppo.num_iterations and (
            guard.requested() or (session.remote is not None and session.remote.signalled))
        if (cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0) \
                or done == ppo.num_iterations or preempted:
            session.sync_ema()
            session.hooks.before_save()
            path = save_checkpoint(
                ckpt_dir, f"iter_{done:06d}", session.roles,
                trainer_state={"iteration": done, "kl_controller": kl_ctl.state_dict()},
                config=dataclasses.asdict(cfg), layout=session.layouts,
                keep_last=cfg.checkpoint.keep_last,
                objects={"rollout_queue": session.rollouts.state_dict(),
                         **({"ref_cache": cache.state_dict()} if cache is not None else {})})
            if preempted:
                mark_preempted(run_dir(cfg), path, guard.signalled)
                bar.close()
                session.close()
                logger.close()
                return {"preempted_at": done}
        result = metrics
    bar.close()
    if session.tracker is not None:
        table = format_table(session.tracker.metrics(whole_run=True),
                             "[ppo] memory per rank, MiB (largest rank; megarlhf plan predicts "
                             "these):")
        print0(table)
        logger.log_text(ppo.num_iterations, "memory", "    " + table.replace("\n", "\n    "))
    session.close()
    logger.close()
    for role in (session.actor, session.critic):  # a short run that went wrong
        if role is not None and role.trained is not None:
            check_runaway(role.trained, role.spec.name, final=True)
    bands.report_unseen()
    print0("[ppo] done: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()
                                       if k.startswith(("eval/", "objective/"))))
    return result


def _waiting_batches(ckpt_dir: str) -> tuple[dict | None, str]:
    """The batches sampled ahead that a checkpoint holds (``ppo.max_staleness``), and why
    there are none when it holds none."""
    try:
        state = load_object(ckpt_dir, "rollout_queue")
    except ValueError as err:
        print0(f"[ppo] warning: {err}")
        return None, "unreadable"
    return state, "saved before ppo.max_staleness existed" if state is None else ""


def _prompt_batch(prompts: list, size: int, group: int, seed: int, it: int) -> list:
    """Iteration ``it``'s ``size`` prompts, each ``group`` times in a row: positions
    it * size ... of one stream that visits every prompt once per epoch, epoch e in the
    order of its own permutation (seeded by ``seed`` and e), so a batch that crosses the
    end of an epoch continues with the next epoch's order."""
    orders: dict[int, torch.Tensor] = {}
    idx = []
    for position in range(it * size, (it + 1) * size):
        epoch, at = divmod(position, len(prompts))
        if epoch not in orders:
            orders[epoch] = torch.randperm(len(prompts), generator=torch.Generator()
                                           .manual_seed(seed + 104729 * epoch))
        idx.append(int(orders[epoch][at]))
    return [prompts[i] for i in idx for _ in range(group)]


@cpu_backend.suspended()  # batch arithmetic: no megatron code
def _share(exp: algos.Experience, layout) -> algos.Experience:
    """This data-parallel rank's contiguous share of a (global) mini-batch."""
    per_rank = algos.exact_div(len(exp), layout.dp, "ppo.mini_batch_size",
                               "the data-parallel size")
    return exp.rows(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)


def _update(cfg, exp, actor, critic, pad_id, it, critic_only, ema, ptx=None,
            meters: dict | None = None) -> dict:
    """``ppo_epochs`` passes of shuffled global mini-batches; actor and critic each take
    their own data-parallel share and step together (or skip together). With PPO-ptx
    each actor mini-batch also carries its pretraining micro-batches. ``meters`` (by role
    name) measure each role's activations during the first epoch: padded, every epoch runs
    the same micro-batch shapes (full prompt + response width), so its peak is the
    phase's; packed, every micro-batch is within the same token budget, but another epoch's
    packing may come closer to it. The saved-tensor hooks cost a Python call per saved
    tensor."""
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
    gen = torch.Generator().manual_seed(cfg.run.seed * 7 + it)
    skipped = 0
    step = 0
    moe_sums: dict[str, dict[str, list[float]]] = {}
    budget = ppo.max_tokens_per_micro_batch  # None: padded micro-batches
    positions = [0, 0]  # token positions computed, and real, by this replica's passes
    for epoch in range(ppo.ppo_epochs):
        with cpu_backend.suspended():  # as experience_batches
            minis = list(exp.mini_batches(ppo.mini_batch_size, gen))
        for mini in minis:
            for role, fwd in learners:
                if budget is not None:
                    batches = packed_experience_batches(mini, role.layout, budget, pad_id,
                                                        routing=role is actor)
                    real = sum(int(b["cu_seqlens"][b["grid"][0]]) for b in batches)
                else:
                    share = _share(mini, role.layout)
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
    out = {"ppo/skipped_steps": skipped}
    computed, real = (sum(x) for x in zip(*gather_objects(positions)))
    out["perf/padding_fraction/train"] = (computed - real) / computed if computed else 0.0
    for name, sums in moe_sums.items():  # the actor's as moe/*, a critic's as moe/critic/*
        for key, values in sums.items():
            out[key if name == "actor" else key.replace("moe/", f"moe/{name}/")] = \
                sum(values) / len(values)
    if "actor" in logs:
        pol = reduce_logs(logs["actor"], actor.layout)
        out.update({"ppo/policy/loss": ratio(pol, "loss_sum", "loss_count"),
                    "ppo/policy/pg_loss": ratio(pol, "pg_loss_sum", "loss_count"),
                    "ppo/policy/clipfrac": ratio(pol, "clipfrac_sum", "tokens"),
                    "ppo/policy/approxkl": ratio(pol, "approxkl_sum", "tokens"),
                    "objective/entropy": ratio(pol, "entropy_sum", "tokens")})
        if ppo.kl_loss_coef:
            out["ppo/policy/kl_loss"] = ratio(pol, "kl_loss_sum", "tokens")
        if ppo.decoupled_loss:
            out["ppo/policy/behavior_weight"] = ratio(
                pol, "behavior_weight_sum", "tokens") / max(
                1.0 - ratio(pol, "behavior_capped_sum", "tokens"), 1e-12)
            out["ppo/policy/behavior_capped_frac"] = ratio(pol, "behavior_capped_sum", "tokens")
        if ptx is not None:
            out["ppo/ptx/loss"] = ratio(pol, "ptx_nll_sum", "ptx_tokens")
    if critic is not None:
        val = reduce_logs(logs["critic"], critic.layout)
        out.update({"ppo/val/loss": ratio(val, "loss_sum", "loss_count"),
                    "ppo/val/clipfrac": ratio(val, "clipfrac_sum", "tokens")})
        ev = algos.explained_variance(exp.values_BT, exp.returns_BT, exp.response_mask_BT)
        out["ppo/val/explained_var"] = float(ev)
    return out


def _evaluator(cfg, sampler, eval_ds, tokenizer, gold_fn):
    """Greedy responses to held-out prompts: gold score (when known), reward-model score
    and length. Runs on the inference layout (weights resharded first)."""

    def evaluate(step: int, resharder=None, prefix: str = "eval/") -> dict:
        """Greedy responses of the actor (or of the model ``resharder`` copies in)."""
        if eval_ds is None:
            return {}
        prompts = eval_ds.prompts[:cfg.ppo.num_eval_prompts]
        (resharder or sampler.resharder)()
        inf = sampler.inference_layout
        mine_idx = list(range(inf.dp_rank, len(prompts), inf.dp))
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True,
                                temperature=cfg.rollout.temperature,
                                stop_token_ids=sampler.stop_token_ids)
        if sampler.episodes is not None:  # the environment's episodes, greedy
            return _evaluate_episodes(cfg, sampler, [prompts[i] for i in mine_idx], mine_idx,
                                      params, tokenizer, prefix)
        gen = generate(sampler.inference_model, [prompts[i] for i in mine_idx], params,
                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       true_vocab=sampler.actor.spec.model.vocab_size,
                       stop_at_eos=cfg.rollout.stop_at_eos)
        if sampler.release_inference:
            release_inference_weights(sampler.inference_model)
        local = torch.zeros(3, dtype=torch.float64)
        if inf.tp_rank == 0:
            local[1] = float(gen.response_mask_BT.sum())
            local[2] = len(mine_idx)
        if gold_fn:  # every rank: a failed call stops them all
            local[0] = gold_on_some_ranks(gold_fn, [
                decode_sample(gen, b, tokenizer.decode) for b in range(len(mine_idx))]
                if inf.tp_rank == 0 else None)
        dist.all_reduce(local)
        out = {f"{prefix}response_len": float(local[1] / local[2])}
        if gold_fn:
            out[f"{prefix}gold_score"] = float(local[0] / local[2])
        return out

    return evaluate


def _evaluate_episodes(cfg, sampler, rows: list, indices: list[int], params, tokenizer,
                       prefix: str) -> dict:
    """Greedy episodes of the environment on this replica's held-out ``rows``: the mean
    return (every turn's reward; the environment's verdict is its gold score), the mean
    model tokens and turns. A collective of the world."""
    stats: dict = {}
    inf = sampler.inference_layout
    if rows:
        gen = sampler.episodes.sample(sampler.inference_model, rows, indices, 0, params=params,
                                      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                      true_vocab=sampler.actor.spec.model.vocab_size,
                                      stats=stats)
    if sampler.release_inference:
        release_inference_weights(sampler.inference_model)
    local = torch.zeros(3, dtype=torch.float64)
    if inf.tp_rank == 0 and rows:
        local[0] = float(gen.env_rewards_BT.sum())
        local[1] = float(gen.model_mask_BT().sum())
        local[2] = len(rows)
    counts = episode_metrics(stats, cfg.rollout.reward_on_error)
    dist.all_reduce(local)
    n = max(float(local[2]), 1.0)
    return {f"{prefix}gold_score": float(local[0]) / n,
            f"{prefix}response_len": float(local[1]) / n,
            f"{prefix}turns": counts["rollout/turns_mean"]}


def _sample_table(gen, exp, tokenizer, logger, step, bar) -> None:
    if dist.get_rank() != 0:
        return
    lines = [f"iteration {step} samples (score | prompt -> response):"]
    for b in range(min(4, gen.response_tokens_BT.shape[0])):
        prompt, response = decode_sample(gen, b, tokenizer.decode)
        score = float(exp.scores_B[b]) if b < len(exp) else float("nan")
        lines.append(f"  {score:+.3f} | {prompt!r} -> {response!r}")
    text = "\n".join(lines)
    bar.write(text)
    logger.log_text(step, "samples", text.replace("\n", "  \n"))
