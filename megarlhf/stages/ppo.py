"""``megarlhf ppo``: the run - a :class:`~megarlhf.ppo.session.PPOSession`, the resume,
the loop of iterations (docs/design.md), samples, evaluation and saves."""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from megarlhf.config import Config, Written
from megarlhf.data.tokenizer import fingerprint
from megarlhf.engine.checkpoint import LATEST_FILE
from megarlhf.memory.accounting import format_table
from megarlhf.engine.metrics import MetricsLogger
from megarlhf.engine.optimizer import check_runaway
from megarlhf.parallel.preemption import PreemptionGuard, mark_preempted
from megarlhf.roles.spec import ppo_role_specs
from megarlhf.parallel import placement
from megarlhf.rollout.sampling import decode_sample
from megarlhf.rollout.remote import serve
from megarlhf.rewards.verifiers import make_verifier
from megarlhf.parallel.rank import print0
from megarlhf.stages.common import MetricBands, check_writable, explain_resume, progress, run_dir
from megarlhf.parallel import watchdog
from megarlhf.ppo.evaluation import make_evaluator
from megarlhf.ppo.session import PPOSession

# an update whose optimizer steps were skipped: its losses, entropy and routers' losses are
# the skipped-step guards' to judge (optimizer.max_consecutive_skipped_steps)
SKIPPED_UPDATE = ("ppo/", "objective/entropy", "moe/")


def run_ppo(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    ppo = cfg.ppo
    gold_fn = make_verifier(cfg.rollout.rewards, fn_path=ppo.gold_reward_fn,
                            name="ppo.gold_reward_fn") if ppo.gold_reward_fn else None
    split = placement.start(cfg)  # rollout.placement.mode=split: this process's part of the job
    check_writable(cfg)  # on a rollout rank too: a stall it notices leaves STALLED there
    if split is not None and not split.training:
        actor = ppo_role_specs(cfg, split.training_world, fingerprint(tokenizer),
                               written=written)["actor"]
        return {"batches_sampled": serve(cfg, tokenizer, split, actor)}
    session = PPOSession(cfg, tokenizer, written, split)
    if split is not None:
        print0(f"[ppo] {split.describe()}")
    ckpt_dir = os.path.join(run_dir(cfg), "checkpoints")
    start = 0
    if cfg.checkpoint.resume and os.path.exists(os.path.join(ckpt_dir, LATEST_FILE)):
        explain_resume(cfg, ckpt_dir)
        start, tag = session.resume(ckpt_dir)
        print0(f"[ppo] resumed {tag} at iteration {start}")
    logger = MetricsLogger(run_dir(cfg), tensorboard=cfg.logging.tensorboard,
                           wandb_project=cfg.logging.wandb_project,
                           config=dataclasses.asdict(cfg), resume_step=start or None)
    evaluate_policy = make_evaluator(cfg, session.sampler, session.eval_prompts, tokenizer,
                                     gold_fn)

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
        bands.check(metrics, f"iteration {done}", skipped=SKIPPED_UPDATE
                    if metrics.get("ppo/skipped_steps") else ())
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
            path = session.save(ckpt_dir, done, records=(logger.path,))
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
