"""``megarlhf ppo``: the PPO iteration of DESIGN.md.

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
import torch.distributed as dist

from megarlhf import algos
from megarlhf.config import Config
from megarlhf.data.batching import prompt_response_batch
from megarlhf.data.datasets import tokenize_dataset
from megarlhf.engine.checkpoint import LATEST_FILE, RoleState, load_checkpoint, read_meta, \
    save_checkpoint, checkpoint_role
from megarlhf.engine.metrics import MetricsLogger
from megarlhf.engine.preemption import PreemptionGuard, mark_preempted
from megarlhf.engine.optimizer import TrainedRole, build_optimizer, forward_backward, \
    step_together, wrap_ddp
from megarlhf.engine.schedule import build_model_chunks
from megarlhf.engine.steps import make_policy_step, make_value_step, sum_logs
from megarlhf.models.gpt import init_weights
from megarlhf.parallel.launch import init_distributed
from megarlhf.rollout.experience import (
    ExperienceMaker, RewardSource, SequenceCache, decode_sample, load_reward_fn)
from megarlhf.rollout.generate import SamplingParams, generate
from megarlhf.rollout.reshard import build_inference_model, inference_layout
from megarlhf.stages.common import print0, progress, run_dir


# ------------------------------------------------------------------ set-up

def _frozen(cfg, layout, kind, path, role_hint):
    chunks = build_model_chunks(cfg, layout, kind)
    for c in chunks:
        init_weights(c, cfg)
        c.eval()
    meta = read_meta(path)
    src = checkpoint_role(meta, role_hint if role_hint in meta["roles"] else None, path)
    load_checkpoint(path, {src: RoleState(chunks)}, load_optimizer=False, load_rng=False)
    for c in chunks:
        for p in c.parameters():
            p.requires_grad_(False)
    return chunks, meta["roles"][src]


def _trained(cfg, layout, kind, lr, total, init_path, role_hint):
    chunks = build_model_chunks(cfg, layout, kind)
    for c in chunks:
        init_weights(c, cfg)
    if init_path:
        meta = read_meta(init_path)
        src = checkpoint_role(meta, role_hint if role_hint in meta["roles"] else None, init_path)
        load_checkpoint(init_path, {src: RoleState(chunks)}, load_optimizer=False,
                        load_rng=False, skip_head=meta["roles"][src].get("kind") != kind)
    model = wrap_ddp(chunks, cfg.optimizer.use_distributed_optimizer, layout.pg_collection)
    opt, sched = build_optimizer(cfg.optimizer, model, lr=lr, total_steps=total)
    return chunks, TrainedRole(model, opt, sched)


def experience_batches(exp: algos.Experience, micro: int, pad_id: int) -> list[dict]:
    out = []
    for mb in exp.micro_batches(micro):
        batch = prompt_response_batch(mb.prompt_tokens_BP, mb.prompt_mask_BP,
                                      mb.response_tokens_BT, mb.response_mask_BT, pad_id)
        batch.update({"response_mask": mb.response_mask_BT.float(),
                      "old_logprobs": mb.old_logprobs_BT, "advantages": mb.advantages_BT,
                      "old_values": mb.values_BT, "returns": mb.returns_BT})
        out.append(batch)
    return out


# ------------------------------------------------------------------ the loop

class PPOSession:
    """Everything one PPO run holds - layouts, the four roles, the experience maker, the
    KL controller - built once; :meth:`iteration` runs stages 1-3 plus the KL update.
    ``run_ppo`` adds evaluation, logging and checkpoints; benchmarks step it directly."""

    def __init__(self, cfg: Config, tokenizer):
        ppo, r = cfg.ppo, cfg.rollout
        if ppo.sft_checkpoint is None:
            raise ValueError("ppo.sft_checkpoint is required (the actor and reference start "
                             "there)")
        if ppo.reward_checkpoint is None and r.reward_fn is None:
            raise ValueError("set ppo.reward_checkpoint or rollout.reward_fn")
        if ppo.ptx_coef > 0:
            raise ValueError("ppo.ptx_coef > 0: PPO-ptx is available as algos.ppo_ptx_objective "
                             "but not wired into `megarlhf ppo` yet; set ppo.ptx_coef=0")
        if cfg.model.hidden_dropout or cfg.model.attention_dropout:
            # Dropout makes the ratio's numerator and denominator come from different networks.
            print0("[ppo] dropout is turned off for RL (model.hidden_dropout/attention_dropout)")
            cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
        self.cfg, self.tokenizer = cfg, tokenizer
        self.prompts = tokenize_dataset(cfg.data.train_path, "prompt", cfg.data, tokenizer)
        self.eval_prompts = tokenize_dataset(cfg.data.eval_path, "prompt", cfg.data, tokenizer) \
            if cfg.data.eval_path else None
        reward_fn = load_reward_fn(r.reward_fn) if r.reward_fn else None

        self.layout = layout = init_distributed(cfg)
        self.sizes = sizes = algos.BatchSizes(ppo.rollout_batch_size, ppo.mini_batch_size,
                                              ppo.micro_batch_size, layout.dp_size,
                                              ppo.group_size).validate()
        print0(f"[ppo] layout {layout.describe()}, rollout TP={r.tensor_parallel_size}; "
               f"{sizes.describe()}; {len(self.prompts)} prompts")
        total_steps = ppo.num_iterations * ppo.ppo_epochs * sizes.num_mini_batches
        self.actor_chunks, self.actor = _trained(cfg, layout, "lm", cfg.optimizer.lr,
                                                 total_steps, ppo.sft_checkpoint, "policy")
        self.critic_chunks, self.critic = None, None
        if ppo.advantage_estimator == "gae":
            critic_src = {"reward": ppo.reward_checkpoint, "sft": ppo.sft_checkpoint,
                          "random": None}[ppo.critic_init]
            self.critic_chunks, self.critic = _trained(cfg, layout, "value",
                                                       cfg.optimizer.critic_lr, total_steps,
                                                       critic_src, "reward")
        reference, _ = _frozen(cfg, layout, "lm", ppo.sft_checkpoint, "policy")
        reward = RewardSource(fn=reward_fn, decode=tokenizer.decode)
        if reward_fn is None:
            rm_chunks, rm_meta = _frozen(cfg, layout, "value", ppo.reward_checkpoint, "reward")
            reward = RewardSource(chunks=rm_chunks, gain=rm_meta.get("score_gain", 1.0),
                                  bias=rm_meta.get("score_bias", 0.0))
        inf_layout = inference_layout(r.tensor_parallel_size)
        self.maker = ExperienceMaker(cfg, layout, inf_layout, self.actor_chunks,
                                     build_inference_model(cfg, inf_layout), reference, reward,
                                     self.critic_chunks, eos_id=tokenizer.eos_id,
                                     pad_id=tokenizer.pad_id, offload=r.offload_frozen_models,
                                     micro_batch_size=ppo.micro_batch_size,
                                     ref_cache=SequenceCache(r.ref_cache_path))
        self.kl_ctl = algos.make_kl_controller(ppo.kl_controller, ppo.init_kl_coef,
                                               ppo.kl_target, ppo.kl_horizon)
        self.ema = algos.ParameterEMA([p for c in self.actor_chunks for p in c.parameters()],
                                      ppo.ema_decay) if ppo.ema_decay else None
        self.roles = {"actor": RoleState(self.actor.model, self.actor.optimizer,
                                         self.actor.scheduler, {"kind": "lm"})}
        if self.critic is not None:
            self.roles["critic"] = RoleState(self.critic.model, self.critic.optimizer,
                                             self.critic.scheduler, {"kind": "value"})

    def iteration(self, it: int) -> tuple[dict, algos.Experience, object]:
        """One PPO iteration: (metrics, experience, generation)."""
        cfg, ppo = self.cfg, self.cfg.ppo
        t_iter = time.perf_counter()
        # 1-2. rollout and experience
        prompts = _prompt_batch(self.prompts.prompts, ppo.rollout_batch_size, ppo.group_size,
                                cfg.run.seed, it)
        exp, gen, metrics = self.maker.make(prompts, seed=cfg.run.seed + it,
                                            kl_coef=self.kl_ctl.value)
        # 3. PPO epochs over shuffled mini-batches
        t_train = time.perf_counter()
        train_critic_only = it < ppo.critic_warmup_iterations
        metrics.update(_update(cfg, exp, self.actor, self.critic, self.layout, self.sizes,
                               self.tokenizer.pad_id, it, train_critic_only, self.ema,
                               self.actor_chunks))
        metrics["timing/train"] = time.perf_counter() - t_train
        # 4. KL controller
        self.kl_ctl.update(metrics["objective/kl"], ppo.rollout_batch_size * ppo.group_size)
        metrics["objective/kl_coef"] = self.kl_ctl.value
        metrics["timing/iteration"] = time.perf_counter() - t_iter
        tokens = exp.response_mask_BT.sum() + exp.prompt_mask_BP.sum()
        metrics["perf/tokens_per_s"] = float(tokens) * self.layout.dp_size \
            / metrics["timing/iteration"]
        metrics["perf/samples_per_s"] = self.sizes.samples / metrics["timing/iteration"]
        return metrics, exp, gen

    def close(self) -> None:
        self.maker.restore_frozen_models()


def run_ppo(cfg: Config, tokenizer) -> dict:
    ppo = cfg.ppo
    gold_fn = load_reward_fn(ppo.gold_reward_fn) if ppo.gold_reward_fn else None
    session = PPOSession(cfg, tokenizer)
    layout, roles, kl_ctl = session.layout, session.roles, session.kl_ctl
    ckpt_dir = os.path.join(run_dir(cfg), "checkpoints")
    start = 0
    if cfg.checkpoint.resume and os.path.exists(os.path.join(ckpt_dir, LATEST_FILE)):
        meta = load_checkpoint(ckpt_dir, roles, layout=layout.describe())
        start = int(meta["trainer"]["iteration"])
        kl_ctl.load_state_dict(meta["trainer"]["kl_controller"])
        print0(f"[ppo] resumed {meta['tag']} at iteration {start}")
    logger = MetricsLogger(run_dir(cfg), tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume_step=start or None)
    evaluate = _evaluator(cfg, session.maker, session.eval_prompts, tokenizer, gold_fn)

    guard = PreemptionGuard()
    bar = progress(ppo.num_iterations, start, "ppo", cfg.logging.progress_bar)
    if start == 0:
        logger.log(0, evaluate(0))
    result = {}
    for it in range(start, ppo.num_iterations):
        metrics, exp, gen = session.iteration(it)
        # 4. evaluation, metrics, samples, checkpoint
        done = it + 1
        if done % ppo.eval_interval == 0 or done == ppo.num_iterations:
            metrics.update(evaluate(done))
        logger.log(done, metrics)
        if cfg.logging.sample_table_interval and (it % cfg.logging.sample_table_interval == 0):
            _sample_table(gen, exp, tokenizer, logger, done, bar)
        bar.update(1)
        bar.set_postfix(score=f"{metrics['objective/score']:.3f}",
                        kl=f"{metrics['objective/kl']:.2f}",
                        gold=f"{metrics.get('eval/gold_score', float('nan')):.2f}")
        preempted = done < ppo.num_iterations and guard.requested()
        if (cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0) \
                or done == ppo.num_iterations or preempted:
            path = save_checkpoint(
                ckpt_dir, f"iter_{done:06d}", roles,
                trainer_state={"iteration": done, "kl_controller": kl_ctl.state_dict()},
                config=dataclasses.asdict(cfg), layout=layout.describe(),
                keep_last=cfg.checkpoint.keep_last)
            if preempted:
                mark_preempted(run_dir(cfg), path)
                bar.close()
                session.close()
                logger.close()
                return {"preempted_at": done}
        result = metrics
    bar.close()
    session.close()
    logger.close()
    print0(f"[ppo] done: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()
                                       if k.startswith(("eval/", "objective/"))))
    return result


def _prompt_batch(prompts: list, size: int, group: int, seed: int, it: int) -> list:
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(
        seed + 104729 * (it * size // max(len(prompts), 1))))
    start = (it * size) % len(prompts)
    idx = [int(order[(start + k) % len(prompts)]) for k in range(size)]
    return [prompts[i] for i in idx for _ in range(group)]


def _update(cfg, exp, actor, critic, layout, sizes, pad_id, it, critic_only, ema, actor_chunks):
    ppo = cfg.ppo
    P = exp.prompt_tokens_BP.shape[1]
    policy_step = make_policy_step(
        prompt_len=P, tp_group=layout.tp_group, true_vocab=cfg.model.vocab_size,
        temperature=cfg.rollout.temperature, clip_eps=ppo.clip_eps, dual_clip=ppo.dual_clip,
        agg=ppo.loss_agg, entropy_coef=ppo.entropy_coef)
    value_step = make_value_step(prompt_len=P, cliprange_value=ppo.cliprange_value,
                                 agg=ppo.loss_agg)
    gen = torch.Generator().manual_seed(cfg.run.seed * 7 + it)
    pol = torch.zeros(6, dtype=torch.float64)
    val = torch.zeros(4, dtype=torch.float64)
    skipped = 0
    S = P + exp.response_tokens_BT.shape[1]
    for _ in range(ppo.ppo_epochs):
        for mini in exp.mini_batches(sizes.mini_batch_per_rank, gen):
            batches = experience_batches(mini, ppo.micro_batch_size, pad_id)
            roles = []
            if not critic_only:
                logs = forward_backward(actor, policy_step, batches, seq_length=S,
                                        micro_batch_size=ppo.micro_batch_size)
                pol += torch.tensor(sum_logs(logs, "policy", 6, layout), dtype=torch.float64)
                roles.append(actor)
            if critic is not None:
                logs = forward_backward(critic, value_step, batches, seq_length=S,
                                        micro_batch_size=ppo.micro_batch_size)
                val += torch.tensor(sum_logs(logs, "value", 4, layout), dtype=torch.float64)
                roles.append(critic)
            if roles:
                ok, _ = step_together(roles)
                skipped += not ok
            if ema is not None and not critic_only:
                ema.update([p for c in actor_chunks for p in c.parameters()])
    out = {"ppo/skipped_steps": skipped}
    if pol[1] > 0:
        n = pol[5]
        out.update({"ppo/policy/loss": float(pol[0] / pol[1]),
                    "ppo/policy/clipfrac": float(pol[2] / n),
                    "ppo/policy/approxkl": float(pol[3] / n),
                    "objective/entropy": float(pol[4] / n)})
    if val[1] > 0:
        out.update({"ppo/val/loss": float(val[0] / val[1]),
                    "ppo/val/clipfrac": float(val[2] / val[3])})
    if critic is not None:
        ev = algos.explained_variance(exp.values_BT, exp.returns_BT, exp.response_mask_BT)
        out["ppo/val/explained_var"] = float(ev)
    return out


def _evaluator(cfg, maker, eval_ds, tokenizer, gold_fn):
    """Greedy responses to held-out prompts: gold score (when known), reward-model score
    and length. Runs on the inference layout (weights resharded first)."""

    def evaluate(step: int) -> dict:
        if eval_ds is None:
            return {}
        prompts = eval_ds.prompts[:cfg.ppo.num_eval_prompts]
        maker.resharder()
        inf = maker.inference_layout
        mine_idx = list(range(inf.dp_rank, len(prompts), inf.dp_size))
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, greedy=True,
                                temperature=cfg.rollout.temperature,
                                stop_token_ids=tuple(cfg.rollout.stop_token_ids))
        gen = generate(maker.inference_model, [prompts[i] for i in mine_idx], params,
                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       true_vocab=cfg.model.vocab_size, stop_at_eos=cfg.rollout.stop_at_eos)
        local = torch.zeros(3, dtype=torch.float64)
        if inf.tp_rank == 0:
            for b in range(len(mine_idx)):
                prompt, response = decode_sample(gen, b, tokenizer.decode)
                local[0] += gold_fn(prompt, response) if gold_fn else 0.0
                local[1] += float(gen.response_mask_BT[b].sum())
                local[2] += 1
        dist.all_reduce(local)
        out = {"eval/response_len": float(local[1] / local[2])}
        if gold_fn:
            out["eval/gold_score"] = float(local[0] / local[2])
        return out

    return evaluate


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
