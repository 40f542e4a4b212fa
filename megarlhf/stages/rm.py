"""``megarlhf rm``: reward-model training with the pairwise Bradley-Terry loss, then
reward normalisation (gain and bias so scores of SFT samples have mean 0, std 1)."""

from __future__ import annotations

import torch

from megarlhf.algos.rewards import fit_score_normalization
from megarlhf.config import Config, Written
from megarlhf.data.batching import batch_length, pad_batch, preference_batch
from megarlhf.data.budgets import train_budget
from megarlhf.data.datasets import tokenize_dataset
from megarlhf.data.packing import pack_rows, unpack
from megarlhf.engine.forward import forward_rows, stack_results
from megarlhf.engine.steps import make_pairwise_rm_step, model_forward, ratio
from megarlhf.parallel.rank import print0
from megarlhf.stages.supervised import SupervisedTask, run_supervised, supervised_spec
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


def pair_tokens(pair) -> int:
    """Token count of a preference pair's two sequences (the last three fields of an
    item: prompt, chosen, rejected)."""
    prompt, chosen, rejected = pair[-3:]
    return 2 * len(prompt) + len(chosen) + len(rejected)


def packed_pairs(pairs: list, pad_id: int) -> dict:
    """Preference pairs as one packed micro-batch (``data.packing.pack_rows``): chosen,
    rejected of each pair back to back, only each sequence's last output kept (where the
    reward is read); every pair real (``pair_mask``)."""
    rows = [row for p, c, r in pairs for row in (p + c, p + r)]
    batch = pack_rows(rows, [[len(row) - 1] for row in rows], pad_id=pad_id)
    batch["pair_mask"] = torch.ones(len(pairs), dtype=torch.bool)
    return batch


def last_token_batch_fn(length: int, pad_id: int):
    """Sequences -> a right-padded micro-batch with each row's last real position."""

    def make_batch(rows: list[list[int]]) -> dict:
        batch = pad_batch([(r, []) for r in rows], length, pad_id)
        del batch["loss_mask"]
        batch["last_index"] = torch.tensor([len(r) - 1 for r in rows])
        return batch

    return make_batch


def last_value_step(data_iterator, model):
    """Forward-only step: the value head's output at each row's ``last_index``."""
    batch = next(data_iterator)
    out = model_forward(model, batch)
    rows = torch.arange(batch["tokens"].shape[0], device=batch["tokens"].device)
    return out, lambda v, non_loss_data=True: {"last": v[rows, batch["last_index"], 0].float()}


def packed_last_value_step(data_iterator, model):
    """Forward-only step on a packed micro-batch keeping each row's last output only
    (``data.packing.pack_rows``): ``last`` per row."""
    batch = next(data_iterator)
    out = model_forward(model, batch, batch["keep"])
    return out, lambda v, non_loss_data=True: {
        "last": unpack(v[..., 0].float(), batch)[:, 0]}


def score_last_tokens(role, seqs: list[list[int]], micro_batch_size: int, max_len: int,
                      pad_id: int, max_tokens: int | None = None) -> torch.Tensor:
    """Raw reward (value head at the last token) of each sequence, on every rank: padded
    micro-batches of ``micro_batch_size`` rows, or packed ones of ``max_tokens``."""
    if max_tokens is not None:
        results = forward_rows(role, seqs, lambda rows: pack_rows(
            rows, [[len(r) - 1] for r in rows], pad_id=pad_id), packed_last_value_step,
            micro_batch_size=1, max_tokens=max_tokens, lengths=[len(s) for s in seqs])
        return stack_results(results, "last").double()
    length = min(batch_length([len(s) for s in seqs]), max_len)
    results = forward_rows(role, seqs, last_token_batch_fn(length, pad_id), last_value_step,
                           micro_batch_size=micro_batch_size)
    return stack_results(results, "last").double()


def run_rm(cfg: Config, tokenizer, written: Written | None = None) -> dict:
    spec = supervised_spec(cfg, "reward", "value", tokenizer, written)
    pairs, eval_pairs = load_pairs(cfg, tokenizer)
    norm_seqs, norm_source = normalization_samples(cfg, tokenizer, pairs)  # read up front
    max_len = min(cfg.data.max_seq_len, spec.model.max_position_embeddings)
    mbs, pad = cfg.train.micro_batch_size, tokenizer.pad_id

    def summarize(totals: dict) -> dict:
        return {"loss": ratio(totals, "loss_sum", "pairs"),
                "accuracy": ratio(totals, "correct", "pairs"),
                "margin": ratio(totals, "margin_sum", "pairs")}

    return run_supervised(cfg, spec, SupervisedTask(
        name="rm", train_items=pairs, eval_items=eval_pairs,
        make_batches=lambda items, training: pair_microbatches(items, mbs, max_len, pad),
        rows_per_micro_batch=2 * mbs, make_step=lambda role: make_pairwise_rm_step(),
        tokens=pair_tokens, make_packed=lambda items: packed_pairs(items, pad), sequences=2,
        summarize=summarize, describe="micro-batches hold chosen and rejected of each pair",
        finish=lambda role: normalize(role, cfg, tokenizer, norm_seqs, norm_source, max_len)),
        tokenizer)


def normalization_samples(cfg: Config, tokenizer, pairs: list) -> tuple[list[list[int]], str]:
    """(sequences, where they come from) that reward normalisation scores:
    ``train.rm_normalize_path`` (prompt, response), else the training pairs' chosen and
    rejected sequences. Read and checked before training."""
    if cfg.train.rm_normalize_path:
        data = tokenize_dataset(cfg.train.rm_normalize_path, "sft", cfg.data, tokenizer)
        seqs = [p + r for p, r in zip(data.prompts, data.responses)]
        source = cfg.train.rm_normalize_path
    else:
        seqs = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
        source = "training pairs (chosen and rejected)"
    budget = train_budget(cfg, sequences=2)  # the budget of the pairs' passes
    longest = max((len(seq) for seq in seqs), default=0)
    if budget is not None and longest > budget:
        raise ValueError(f"{source}: a sequence of {longest} tokens exceeds "
                         f"train.max_tokens_per_micro_batch={budget}, which packs the "
                         "normalisation pass too")
    return seqs, source


def normalize(role, cfg: Config, tokenizer, seqs: list[list[int]], source: str,
              max_len: int) -> dict:
    """Ziegler et al.: gain and bias so that scores of ``seqs`` (SFT samples,
    :func:`normalization_samples`) have mean 0, std 1."""
    raw = score_last_tokens(role, seqs, cfg.train.micro_batch_size, max_len, tokenizer.pad_id,
                            train_budget(cfg, sequences=2))
    gain, bias = fit_score_normalization(raw)
    print0(f"[rm] reward normalisation on {len(seqs)} samples from {source}: raw mean "
           f"{raw.mean():.4f} std {raw.std(unbiased=False):.4f} -> gain {gain:.4f} "
           f"bias {bias:.4f}")
    return {"score_gain": gain, "score_bias": bias, "raw_score_mean": float(raw.mean()),
            "raw_score_std": float(raw.std(unbiased=False))}
