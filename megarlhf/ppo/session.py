"""One PPO run's parts, built once (docs/design.md).

Each iteration reads as numbered stages:
1. rollout (reshard the actor into the inference layout, sample) and 2. experience
(reference, reward, values, shaped rewards, advantages) - one ``ExperienceMaker.make`` call;
3. ``ppo_epochs`` of shuffled mini-batch updates of actor and critic, stepping together;
4. KL-controller update, EMA, metrics, samples, evaluation, checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from megarlhf import algos
from megarlhf.config import Config, Written
from megarlhf.data.budgets import forward_budget
from megarlhf.data.datasets import episode_rows, tokenize_dataset
from megarlhf.data.tokenizer import fingerprint
from megarlhf.engine.checkpoint import load_checkpoint, load_object, save_checkpoint
from megarlhf.memory.accounting import ActivationMeter, MemoryTracker
from megarlhf.roles.offload import TrainedOffloader
from megarlhf.roles.spec import batch_sizes, ppo_role_specs
from megarlhf.roles.build import Role, build_role
from megarlhf.parallel.launch import init_distributed, read_dist_env
from megarlhf.parallel.placement import Split
from megarlhf.rollout.agents import episode_sampler
from megarlhf.rollout.judge import make_judge
from megarlhf.rollout.experience import ExperienceMaker, Sampled
from megarlhf.inference.reshard import Resharder, build_inference_model, inference_layout
from megarlhf.rollout.sampling import Sampler
from megarlhf.rollout.remote import RemoteRollout
from megarlhf.rollout.schedule import Later, StaleSchedule, staleness_metrics
from megarlhf.rollout.scoring import RewardSource, Scorer, SequenceCache
from megarlhf.rewards.verifiers import make_verifier
from megarlhf.parallel.rank import print0
from megarlhf.ppo.learner import Learner, PtxData
from megarlhf.algos.seeds import derive_seed


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
        self.sizes = batch_sizes(cfg, specs, world)
        forward_tokens = forward_budget(cfg)
        self.cfg, self.tokenizer = cfg, tokenizer
        # episodes (an environment's, an agent's) start from data rows, else from prompts
        read = (lambda path: episode_rows(path, cfg.data)) if r.episodic else \
            (lambda path: tokenize_dataset(path, "prompt", cfg.data, tokenizer))
        self.prompts = read(cfg.data.train_path)
        self.eval_prompts = read(cfg.data.eval_path) if cfg.data.eval_path else None
        for ds in (self.prompts, self.eval_prompts):
            if ds is not None:
                print0(f"[ppo] {ds.report()}")
        # a programmatic reward: a function in worker processes, or a reward server
        # (an agent's episodes are scored where they are played: rollout.agents)
        reward_fn = None if r.agent.enabled else \
            make_verifier(r.rewards, fn_path=r.rewards.fn) if r.rewards.fn else \
            make_verifier(r.rewards, url=r.rewards.url) if r.rewards.url else None
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
        self.reference = Role(specs["reference"], self.actor.layout, self.actor.chunks,
                              source="the actor, adapters off") \
            if specs["reference"].adapters_off else build_role(specs["reference"], seed=seed)
        judge = make_judge(r.judge, r.rewards, build_role(specs["judge"], seed=seed),
                           tokenizer, log_dir=os.path.join(cfg.run.output_dir, cfg.run.name),
                           add_bos=cfg.tokenizer.add_bos) \
            if "judge" in specs else None
        reward = RewardSource(fn=reward_fn, decode=tokenizer.decode,
                              role=build_role(specs["reward"], seed=seed)
                              if "reward" in specs else None, judge=judge)
        teacher = build_role(specs["teacher"], seed=seed) if "teacher" in specs else None
        inf_layout = inference_layout(r.tensor_parallel_size, specs["actor"].model)
        self.sampler = Sampler(r, self.actor, inf_layout,
                               build_inference_model(specs["actor"], inf_layout),
                               eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                               release_inference=r.release_inference_weights,
                               end_ids=tokenizer.end_ids,
                               episodes=episode_sampler(r, cfg.data, tokenizer))
        self.scorer = Scorer(r, self.actor, self.reference, reward, self.critic,
                             pad_id=tokenizer.pad_id,
                             micro_batch_size=r.forward_micro_batch_size
                             or ppo.micro_batch_size, max_tokens=forward_tokens,
                             ref_cache=SequenceCache(r.ref_cache_size)
                             if r.ref_cache_size else None, teacher=teacher)
        # rollout.placement.mode=split: the rollout ranks sample, this world scores and trains
        self.remote = RemoteRollout(r.placement, split, self.sampler) if split is not None else None
        self.maker = ExperienceMaker(ppo, r, self.sampler, self.scorer, remote=self.remote)
        self.rollouts = StaleSchedule(ppo.max_staleness, ppo.num_iterations,
                                      self.sample_batch, log=print0)
        self.kl_ctl = algos.make_kl_controller(ppo.kl.controller, ppo.kl.init_coef,
                                               ppo.kl.target, ppo.kl.horizon)
        # EMA of the actor (evaluation only): its own frozen role at the actor's layout, so
        # it is checkpointed, resumed, evaluated, scored and exported like any role.
        self.ema = self.ema_role = None
        if ppo.ema_decay:
            self.ema = algos.ParameterEMA(self.actor.parameters, ppo.ema_decay)
            self.ema_role = build_role(dataclasses.replace(specs["actor"], name="ema",
                                                           optimizer=None), seed=seed)
            self.ema_resharder = Resharder(self.ema_role.chunks, self.sampler.inference_model)
        self.learner = Learner(cfg, self.actor, self.critic, pad_id=tokenizer.pad_id,
                               ema=self.ema, ptx=self.ptx)
        self.trained = {"actor": self.actor}
        if self.critic is not None:
            self.trained["critic"] = self.critic
        self.tracker = MemoryTracker({
            "actor": self.actor, "critic": self.critic,
            "reference": None if specs["reference"].adapters_off else self.reference,
            "reward": reward.role, "teacher": teacher, "ema": self.ema_role,
            "inference": [self.sampler.inference_model]}) if cfg.logging.memory_metrics else None
        self.hooks = self.sampler.hooks = self.scorer.hooks = PhaseHooks(self.trained,
                                                                          self.tracker)
        built = {"actor": self.actor, "critic": self.critic, "reference": self.reference,
                 "reward": reward.role, "teacher": teacher}
        self.layouts = describe_layouts({k: v for k, v in built.items() if v is not None})
        for spec in specs.values():
            print0(f"[ppo] {spec.describe()}")
        print0(f"[ppo] rollout TP={r.tensor_parallel_size} x {inf_layout.dp} replicas; "
               f"{self.sizes['actor'].describe()}; {len(self.prompts)} prompts")

    @property
    def roles(self) -> dict:
        """The checkpoint states of the trained roles and the EMA actor (with the tokenizer
        they were trained with)."""
        only = self.cfg.checkpoint.adapters_only
        states = {name: role.state(only) for name, role in self.trained.items()}
        if self.ema_role is not None:
            states["ema"] = self.ema_role.state(only)
            states["ema"].extra.update(decay=self.ema.decay, num_updates=self.ema.num_updates)
        for state in states.values():
            state.extra["tokenizer"] = self.tokenizer_fingerprint
        return states

    def state_dict(self) -> dict:
        """What a checkpoint holds beside the roles' weights: the trainer state (the KL
        controller) and the objects saved beside the weights - the batches sampled ahead
        (``ppo.max_staleness``) and the reference log-prob cache."""
        cache = self.scorer.ref_cache
        return {"trainer": {"kl_controller": self.kl_ctl.state_dict()},
                "objects": {"rollout_queue": self.rollouts.state_dict(),
                            **({"ref_cache": cache.state_dict()} if cache is not None else {})}}

    def load_state_dict(self, state: dict, iteration: int, why_no_queue: str = "") -> None:
        """:meth:`state_dict`'s content back (an object may be None: unreadable or absent),
        the run resuming at ``iteration``."""
        self.kl_ctl.load_state_dict(state["trainer"]["kl_controller"])
        cache, saved_cache = self.scorer.ref_cache, state["objects"].get("ref_cache")
        if cache is not None and saved_cache is not None:
            cache.load_state_dict(saved_cache)
        self.rollouts.load_state_dict(state["objects"].get("rollout_queue"), start=iteration,
                                      why=why_no_queue)

    def save(self, ckpt_dir: str, iteration: int, records: tuple[str, ...] = ()) -> str:
        """A checkpoint after ``iteration`` iterations: the trained roles, the EMA actor and
        :meth:`state_dict`, with checksums of the run's ``records`` (its metrics file).
        Returns its path."""
        self.sync_ema()
        self.hooks.before_save()
        state = self.state_dict()
        return save_checkpoint(
            ckpt_dir, f"iter_{iteration:06d}", self.roles,
            trainer_state={"iteration": iteration, **state["trainer"]},
            config=dataclasses.asdict(self.cfg), layout=self.layouts,
            keep_last=self.cfg.checkpoint.keep_last, objects=state["objects"],
            records=records)

    def resume(self, ckpt_dir: str) -> tuple[int, str]:
        """Load the newest checkpoint under ``ckpt_dir``: (the iteration it was saved
        after, its tag). A damaged object (a cache, the waiting batches) is said and
        started empty."""
        meta = load_checkpoint(ckpt_dir, self.roles, layout=self.layouts)
        start = int(meta["trainer"]["iteration"])
        self.restore_ema(meta)
        try:
            saved_cache = load_object(ckpt_dir, "ref_cache")
        except ValueError as err:  # a cache: safe to start empty
            print0(f"[ppo] warning: {err}; the reference log-prob cache starts empty")
            saved_cache = None
        waiting, why = _waiting_batches(ckpt_dir)
        self.load_state_dict({"trainer": meta["trainer"],
                              "objects": {"ref_cache": saved_cache, "rollout_queue": waiting}},
                             start, why)
        return start, meta["tag"]

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
                             derive_seed("prompt_round", self.cfg.run.seed, round_), it)

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
        ppo = self.cfg.ppo
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
        update = self.learner.update(exp, it, train_critic_only, meters)
        metrics.update(update.as_dict())
        self.hooks.after_train()
        metrics["timing/train"] = time.perf_counter() - t_train
        if self.remote is not None:  # rollout.placement.partial: the batch being sampled takes the
            self.remote.push(it + 1)  # new weights for its remaining tokens
        self.rollouts.settle()  # split: the batch the rollout ranks sampled meanwhile
        if self.remote is not None:
            metrics.update(self.remote.take_sync_metrics())
        if update.skipped_steps:
            print0(f"[ppo] iteration {it + 1}: {update.skipped_steps} optimizer step(s) "
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
                                           .manual_seed(derive_seed("prompt_epoch", seed,
                                                                    epoch)))
        idx.append(int(orders[epoch][at]))
    return [prompts[i] for i in idx for _ in range(group)]
