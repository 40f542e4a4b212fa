"""``megarlhf rm``: reward-model training with the pairwise Bradley-Terry loss, then
reward normalisation (gain and bias so scores of SFT samples have mean 0, std 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.algos.rewards import fit_score_normalization
from megarlhf.config import Config
from megarlhf.data.batching import batch_length, pad_batch, preference_batch
from megarlhf.data.datasets import tokenize_dataset
from megarlhf.engine.optimizer import train_step
from megarlhf.engine.preemption import PreemptionGuard, mark_preempted
from megarlhf.engine.schedule import forward_only
from megarlhf.engine.steps import make_pairwise_rm_step, model_forward, sum_logs
from megarlhf.stages.common import (
    StepPlan, check_plan, evaluate, global_batches, print0, progress, rank_share, run_dir,
    setup_stage)
from megarlhf.stages.sft import split_eval


def load_pairs(cfg: Config, tokenizer):
    data = tokenize_dataset(cfg.data.train_path, "preference", cfg.data, tokenizer)
    print0(data.report())
    pairs = list(zip(data.prompts, data.chosen, data.rejected))
    if cfg.data.eval_path:
        held = tokenize_dataset(cfg.data.eval_path, "preference", cfg.data, tokenizer)
        print0(held.report())
        return pairs, list(zip(held.prompts, held.chosen, held.rejected))
    if cfg.data.eval_fraction > 0:
        train_idx, eval_idx = split_eval(data, cfg.data.eval_fraction, cfg.run.seed)
        return [pairs[i] for i in train_idx], [pairs[i] for i in eval_idx]
    return pairs, []


def pair_microbatches(pairs: list, pairs_per_micro: int, max_len: int, pad_id: int
                      ) -> tuple[list[dict], int]:
    """Micro-batches of ``pairs_per_micro`` pairs (2x rows); a short last one is topped up
    with copies of its first pair, masked out of the loss by ``pair_mask``."""
    if not pairs:
        return [], 0
    length = min(batch_length([len(p) + max(len(c), len(r)) for p, c, r in pairs]), max_len)
    out = []
    for start in range(0, len(pairs), pairs_per_micro):
        chunk = pairs[start:start + pairs_per_micro]
        real = len(chunk)
        chunk = chunk + [chunk[0]] * (pairs_per_micro - real)
        batch = preference_batch(chunk, length, pad_id)
        batch["pair_mask"] = torch.arange(pairs_per_micro) < real
        out.append(batch)
    return out, length


def score_last_tokens(stage, seqs: list[list[int]], micro_batch_size: int, max_len: int,
                      pad_id: int) -> torch.Tensor:
    """Raw reward (value head at the last token) of each sequence, on every rank."""
    layout = stage.layout
    mine = list(range(layout.dp_rank, len(seqs), layout.dp_size))
    mine += [-1] * (-len(mine) % micro_batch_size)
    length = min(batch_length([len(s) for s in seqs]), max_len)
    batches, groups = [], []
    for start in range(0, len(mine), micro_batch_size):
        idx = mine[start:start + micro_batch_size]
        rows = [seqs[i] if i >= 0 else seqs[0] for i in idx]
        batch = pad_batch([(r, []) for r in rows], length, pad_id)
        del batch["loss_mask"]
        batch["last_index"] = torch.tensor([len(r) - 1 for r in rows])
        batches.append(batch)
        groups.append(idx)

    def step(data_iterator, model):
        batch = next(data_iterator)
        out = model_forward(model, batch)
        rows = torch.arange(batch["tokens"].shape[0])
        return out, lambda v, non_loss_data=True: v[rows, batch["last_index"], 0].float()

    outs = forward_only(stage.role.model, step, batches, seq_length=length,
                        micro_batch_size=micro_batch_size)
    scores = torch.zeros(len(seqs), dtype=torch.float64)
    if layout.is_last_stage and layout.tp_rank == 0:
        for idx, values in zip(groups, outs):
            for i, v in zip(idx, values.tolist()):
                if i >= 0:
                    scores[i] = v
    if dist.is_initialized():
        dist.all_reduce(scores)
    return scores


def run_rm(cfg: Config, tokenizer) -> dict:
    pairs, eval_pairs = load_pairs(cfg, tokenizer)
    train = cfg.train
    max_len = min(cfg.data.max_seq_len, cfg.model.max_position_embeddings)

    def plan_for(dp_size: int) -> StepPlan:
        return StepPlan(train.global_batch_size, train.micro_batch_size, dp_size,
                        len(pairs), train.num_epochs, train.max_steps)

    check_plan(cfg, plan_for)
    stage = setup_stage(cfg, name="reward", kind="value",
                        total_steps=lambda dp: plan_for(dp).total_steps)
    layout, plan = stage.layout, plan_for(stage.layout.dp_size)
    print0(f"[rm] {len(pairs)} train / {len(eval_pairs)} eval pairs; {plan.describe()} "
           "(micro-batches hold chosen and rejected of each pair)")
    step_fn = make_pairwise_rm_step()
    mbs, pad = train.micro_batch_size, tokenizer.pad_id

    def run_eval(step: int) -> float | None:
        if not eval_pairs:
            return None
        batches, length = pair_microbatches(eval_pairs[layout.dp_rank::layout.dp_size], mbs,
                                            max_len, pad)
        loss_sum, n, correct, margin = evaluate(stage, step_fn, batches, length, 2 * mbs,
                                                "rm", 4)
        acc = correct / max(n, 1)
        stage.logger.log(step, {"eval/loss": loss_sum / max(n, 1), "eval/accuracy": acc,
                                "eval/margin": margin / max(n, 1)})
        return acc

    guard = PreemptionGuard()
    bar = progress(plan.total_steps, stage.start_step, "rm", cfg.logging.progress_bar)
    result = {"eval_accuracy_start": run_eval(0) if stage.start_step == 0 else None}
    for step, epoch, indices in global_batches(plan, cfg.run.seed, stage.start_step):
        mine = [pairs[i] for i in rank_share(indices, layout)]
        batches, length = pair_microbatches(mine, mbs, max_len, pad)
        logs, applied, grad_norm = train_step(stage.role, step_fn, batches,
                                              seq_length=length, micro_batch_size=2 * mbs)
        loss_sum, n, correct, margin = sum_logs(logs, "rm", 4, layout)
        done = step + 1
        metrics = {"train/loss": loss_sum / max(n, 1), "train/accuracy": correct / max(n, 1),
                   "train/margin": margin / max(n, 1), "train/grad_norm": grad_norm,
                   "train/lr": stage.role.optimizer.param_groups[0]["lr"],
                   "train/epoch": epoch, "train/skipped_steps": stage.role.num_skipped_steps}
        if done % cfg.logging.log_interval == 0 or done == plan.total_steps:
            stage.logger.log(done, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", acc=f"{metrics['train/accuracy']:.2f}")
        result["train_loss"] = metrics["train/loss"]
        if train.eval_interval and done % train.eval_interval == 0 and done < plan.total_steps:
            run_eval(done)
        if cfg.checkpoint.save_interval and done % cfg.checkpoint.save_interval == 0 \
                and done < plan.total_steps:
            stage.save(done)
        if done < plan.total_steps and guard.requested():
            mark_preempted(run_dir(cfg), stage.save(done))
            bar.close()
            stage.logger.close()
            return {"preempted_at": done}
    bar.close()
    result["eval_accuracy_end"] = run_eval(plan.total_steps)
    result.update(normalize(stage, cfg, tokenizer, pairs, mbs, max_len))
    stage.extra.update({"score_gain": result["score_gain"], "score_bias": result["score_bias"]})
    stage.save(plan.total_steps)
    stage.logger.close()
    print0(f"[rm] done: {result}")
    return result


def normalize(stage, cfg: Config, tokenizer, pairs: list, micro_batch_size: int,
              max_len: int) -> dict:
    """Ziegler et al.: gain and bias so that scores of SFT samples have mean 0, std 1.
    Samples come from ``train.rm_normalize_path`` (prompt, response), else the training
    pairs' responses."""
    if cfg.train.rm_normalize_path:
        data = tokenize_dataset(cfg.train.rm_normalize_path, "sft", cfg.data, tokenizer)
        seqs = [p + r for p, r in zip(data.prompts, data.responses)]
        source = cfg.train.rm_normalize_path
    else:
        seqs = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
        source = "training pairs (chosen and rejected)"
    raw = score_last_tokens(stage, seqs, micro_batch_size, max_len, tokenizer.pad_id)
    gain, bias = fit_score_normalization(raw)
    print0(f"[rm] reward normalisation on {len(seqs)} samples from {source}: raw mean "
           f"{raw.mean():.4f} std {raw.std(unbiased=False):.4f} -> gain {gain:.4f} "
           f"bias {bias:.4f}")
    return {"score_gain": gain, "score_bias": bias, "raw_score_mean": float(raw.mean()),
            "raw_score_std": float(raw.std(unbiased=False))}
