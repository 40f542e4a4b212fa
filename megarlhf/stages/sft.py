"""``megarlhf sft``: supervised fine-tuning, next-token loss on response tokens only."""

from __future__ import annotations

import torch

from megarlhf.config import Config, Written
from megarlhf.data.batching import batch_length, pack_examples, pad_batch, stack_batches
from megarlhf.data.budgets import train_budget
from megarlhf.data.datasets import TokenizedDataset, tokenize_dataset
from megarlhf.data.packing import pack_weighted
from megarlhf.engine.steps import make_lm_loss_step, ratio
from megarlhf.parallel.rank import print0
from megarlhf.stages.supervised import SupervisedTask, run_supervised, supervised_spec


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
    examples = train.examples()
    if cfg.data.eval_path:
        held = tokenize_dataset(cfg.data.eval_path, "sft", cfg.data, tokenizer)
        print0(held.report())
        return examples, held.examples()
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


def run_sft(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    spec = supervised_spec(cfg, "policy", "lm", tokenizer, written)
    examples, eval_examples = load_sft_data(cfg, tokenizer)
    max_len = min(cfg.data.max_seq_len, spec.model.max_position_embeddings)
    mbs, pad = cfg.train.micro_batch_size, tokenizer.pad_id

    def make_batches(items: list, training: bool):
        return make_microbatches(items, mbs, packing=cfg.data.packing and training,
                                 max_len=max_len, pad_id=pad)

    def summarize(totals: dict) -> dict:
        return {"loss": ratio(totals, "loss_sum", "tokens"), "tokens": totals.get("tokens", 0.0)}

    return run_supervised(cfg, spec, SupervisedTask(
        name="sft", train_items=examples,
        eval_items=eval_examples, make_batches=make_batches, rows_per_micro_batch=mbs,
        make_step=lambda role: make_lm_loss_step(tp_group=role.layout.tp_group,
                                                 true_vocab=role.spec.model.vocab_size),
        summarize=summarize, describe=describe(cfg),
        tokens=lambda example: len(example[0]),
        make_packed=lambda items: pack_weighted(items, pad_id=pad)), tokenizer)


def describe(cfg: Config) -> str:
    if train_budget(cfg) is not None:
        return "packed micro-batches (train.max_tokens_per_micro_batch)"
    return f"packing {'on: rows of data.max_seq_len' if cfg.data.packing else 'off'}"
