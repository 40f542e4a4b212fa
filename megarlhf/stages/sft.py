"""``megarlhf sft``: supervised fine-tuning, next-token loss on response tokens only."""

from __future__ import annotations

import math

import torch

from megarlhf.config import Config
from megarlhf.data.batching import batch_length, pack_examples, pad_batch, sft_example, stack_batches
from megarlhf.data.datasets import TokenizedDataset, tokenize_dataset
from megarlhf.engine.optimizer import train_step
from megarlhf.engine.preemption import PreemptionGuard, mark_preempted
from megarlhf.engine.steps import make_lm_loss_step, sum_logs
from megarlhf.stages.common import (
    StepPlan, check_plan, evaluate, global_batches, print0, progress, rank_share, run_dir,
    setup_stage)


def split_eval(data: TokenizedDataset, fraction: float, seed: int):
    """Hold out a fixed random ``fraction`` of the rows (at least one)."""
    n = len(data)
    num_eval = max(1, int(round(n * fraction)))
    if num_eval >= n:
        raise ValueError(f"data.eval_fraction={fraction} leaves no training rows out of {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[num_eval:]), sorted(order[:num_eval])


def load_sft_data(cfg: Config, tokenizer):
    train = tokenize_dataset(cfg.data.train_path, "sft", cfg.data, tokenizer)
    print0(train.report())
    examples = [sft_example(p, r) for p, r in zip(train.prompts, train.responses)]
    if cfg.data.eval_path:
        held = tokenize_dataset(cfg.data.eval_path, "sft", cfg.data, tokenizer)
        print0(held.report())
        return examples, [sft_example(p, r) for p, r in zip(held.prompts, held.responses)]
    if cfg.data.eval_fraction > 0:
        train_idx, eval_idx = split_eval(train, cfg.data.eval_fraction, cfg.run.seed)
        return [examples[i] for i in train_idx], [examples[i] for i in eval_idx]
    return examples, []


def make_microbatches(examples: list, micro_batch_size: int, *, packing: bool,
                      max_len: int, pad_id: int) -> tuple[list[dict], int]:
    """Rows (padded, or packed into ``max_len``) grouped into full micro-batches; the last
    one is topped up with empty rows (loss weight 0) because pipeline stages exchange
    fixed-shape activations. Returns (micro-batches, sequence length)."""
    if not examples:
        return [], 0
    if packing:
        rows, length = pack_examples(examples, max_len, pad_id), max_len
    else:
        length = min(batch_length([len(t) for t, _ in examples]), max_len)
        rows = [pad_batch([e], length, pad_id) for e in examples]
    filler = dict(rows[0])
    filler = {k: torch.zeros_like(v) if k != "position_ids" else v for k, v in filler.items()}
    if "attention_mask" in filler:
        filler["attention_mask"] = ~torch.ones(length, length, dtype=torch.bool).tril().view(
            1, 1, length, length)
    rows += [filler] * (-len(rows) % micro_batch_size)
    return [stack_batches(rows[i:i + micro_batch_size])
            for i in range(0, len(rows), micro_batch_size)], length


def run_sft(cfg: Config, tokenizer) -> dict:
    examples, eval_examples = load_sft_data(cfg, tokenizer)
    train = cfg.train
    max_len = min(cfg.data.max_seq_len, cfg.model.max_position_embeddings)

    def plan_for(dp_size: int) -> StepPlan:
        return StepPlan(train.global_batch_size, train.micro_batch_size, dp_size,
                        len(examples), train.num_epochs, train.max_steps)

    check_plan(cfg, plan_for)
    stage = setup_stage(cfg, name="policy", kind="lm",
                        total_steps=lambda dp: plan_for(dp).total_steps)
    layout, plan = stage.layout, plan_for(stage.layout.dp_size)
    print0(f"[sft] {len(examples)} train / {len(eval_examples)} eval samples; {plan.describe()}"
           f"; packing {'on' if cfg.data.packing else 'off'}")
    step_fn = make_lm_loss_step(tp_group=layout.tp_group, true_vocab=cfg.model.vocab_size)
    mbs, pad = train.micro_batch_size, tokenizer.pad_id

    def run_eval(step: int) -> float | None:
        if not eval_examples:
            return None
        mine = eval_examples[layout.dp_rank::layout.dp_size]
        batches, length = make_microbatches(mine, mbs, packing=False, max_len=max_len,
                                            pad_id=pad)
        loss_sum, tokens = evaluate(stage, step_fn, batches, length, mbs, "lm", 2)
        loss = loss_sum / max(tokens, 1)
        stage.logger.log(step, {"eval/loss": loss, "eval/tokens": tokens})
        return loss

    guard = PreemptionGuard()
    bar = progress(plan.total_steps, stage.start_step, "sft", cfg.logging.progress_bar)
    first_eval = run_eval(stage.start_step) if stage.start_step == 0 else None
    last = {"eval_loss_start": first_eval}
    step = stage.start_step
    for step, epoch, indices in global_batches(plan, cfg.run.seed, stage.start_step):
        mine = [examples[i] for i in rank_share(indices, layout)]
        batches, length = make_microbatches(mine, mbs, packing=cfg.data.packing,
                                            max_len=max_len, pad_id=pad)
        logs, applied, grad_norm = train_step(stage.role, step_fn, batches,
                                              seq_length=length, micro_batch_size=mbs)
        loss_sum, tokens = sum_logs(logs, "lm", 2, layout)
        loss = loss_sum / max(tokens, 1)
        done = step + 1
        metrics = {"train/loss": loss, "train/tokens": tokens, "train/grad_norm": grad_norm,
                   "train/lr": stage.role.optimizer.param_groups[0]["lr"],
                   "train/epoch": epoch, "train/skipped_steps": stage.role.num_skipped_steps}
        if done % cfg.logging.log_interval == 0 or done == plan.total_steps:
            stage.logger.log(done, metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", gnorm=f"{grad_norm:.2f}" if math.isfinite(
            grad_norm) else "nan")
        last["train_loss"] = loss
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
        step = done
    bar.close()
    last["eval_loss_end"] = run_eval(plan.total_steps)
    stage.save(plan.total_steps)
    stage.logger.close()
    print0(f"[sft] done: {last}")
    return last
