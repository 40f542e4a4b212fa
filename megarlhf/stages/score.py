"""``megarlhf score``: per-token log-probs (and values) of given sequences at any layout.

Input JSONL rows hold ``tokens`` (a list of ids) or ``text`` (encoded with the configured
tokenizer). Output rows: ``tokens``; for ``--role lm`` ``logprobs`` and ``entropy``
(one per token after the first: the log-prob of token t+1 given tokens <= t); for
``--role value`` ``values`` (one per token).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megarlhf.config import Config
from megarlhf.engine.checkpoint import RoleState, checkpoint_role, load_checkpoint, read_meta
from megarlhf.engine.schedule import build_model_chunks, chunked, forward_only, set_eval
from megarlhf.engine.steps import make_score_step
from megarlhf.models.gpt import init_weights
from megarlhf.parallel.launch import ParallelLayout, init_distributed


def read_sequences(path: str, tokenizer=None, vocab_size: int | None = None) -> list[list[int]]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist")
    seqs = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from None
            if isinstance(row, dict) and "tokens" in row:
                tokens = row["tokens"]
                if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
                    raise ValueError(f"{path}:{line_no}: 'tokens' must be a list of integers")
            elif isinstance(row, dict) and "text" in row:
                if tokenizer is None:
                    raise ValueError(f"{path}:{line_no}: a 'text' row needs tokenizer.path")
                tokens = tokenizer.encode(row["text"], add_bos=True)
            else:
                raise ValueError(f"{path}:{line_no}: each row needs 'tokens' or 'text'")
            if len(tokens) < 2:
                raise ValueError(f"{path}:{line_no}: a sequence needs at least 2 tokens")
            if vocab_size is not None and (min(tokens) < 0 or max(tokens) >= vocab_size):
                raise ValueError(f"{path}:{line_no}: token id out of range [0, {vocab_size})")
            seqs.append(tokens)
    if not seqs:
        raise ValueError(f"input {path!r} holds no sequences")
    return seqs


def right_padded_batch(seqs: list[list[int]], length: int, pad_id: int = 0) -> dict:
    """Right padding needs no attention mask: causal attention never looks ahead."""
    tokens = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, :len(seq)] = torch.tensor(seq)
    positions = torch.arange(length).expand(len(seqs), -1).contiguous()
    return {"tokens": tokens, "position_ids": positions}


def score_sequences(cfg: Config, layout: ParallelLayout, model_chunks: list,
                    seqs: list[list[int]], *, role: str, micro_batch_size: int,
                    temperature: float = 1.0) -> list[dict] | None:
    """Score ``seqs`` (every rank passes the same list); rank 0 gets the rows, in order."""
    set_eval(model_chunks)
    mine = list(range(layout.dp_rank, len(seqs), layout.dp_size))
    length = max(len(s) for s in seqs)
    # Data-parallel replicas are independent in a forward-only pass; the TP and PP peers
    # of one replica share a dp_rank and so run the same micro-batches.
    # Pipeline stages exchange fixed-shape activations: every micro-batch is full, the
    # last one topped up with dummy rows (index -1) whose outputs are dropped.
    mine += [-1] * (-len(mine) % micro_batch_size)
    groups = list(chunked(mine, micro_batch_size))
    batches = [right_padded_batch([seqs[i] if i >= 0 else [0, 0] for i in idx], length)
               for idx in groups]
    step = make_score_step(role, tp_group=layout.tp_group, true_vocab=cfg.model.vocab_size,
                           temperature=temperature)
    outputs = forward_only(model_chunks, step, batches, seq_length=length,
                           micro_batch_size=micro_batch_size)
    rows = []
    if layout.is_last_stage and layout.tp_rank == 0:
        for idx, out in zip(groups, outputs):
            for b, i in enumerate(idx):
                if i < 0:
                    continue
                n = len(seqs[i])
                row = {"index": i, "tokens": seqs[i]}
                if role == "value":
                    row["values"] = out["values"][b, :n].tolist()
                else:
                    row["logprobs"] = out["logprobs"][b, :n - 1].tolist()
                    row["entropy"] = out["entropy"][b, :n - 1].tolist()
                rows.append(row)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() != 0:
        return None
    merged = sorted((r for part in gathered for r in part), key=lambda r: r["index"])
    assert [r["index"] for r in merged] == list(range(len(seqs)))
    for r in merged:
        del r["index"]
    return merged


def load_or_init(cfg: Config, model_chunks: list, ckpt_role: str | None = None) -> str:
    """Weights from ``checkpoint.load`` if set (its only role, or ``ckpt_role``), else the
    seeded random initialisation."""
    if cfg.checkpoint.load:
        meta = read_meta(cfg.checkpoint.load)
        role = checkpoint_role(meta, ckpt_role, cfg.checkpoint.load)
        load_checkpoint(cfg.checkpoint.load, {role: RoleState(model_chunks)},
                        load_optimizer=False, load_rng=False)
        return f"checkpoint {cfg.checkpoint.load} (role {role}, step {meta['trainer'].get('step')})"
    for chunk in model_chunks:
        init_weights(chunk, cfg)
    return f"random init, seed {cfg.run.seed}"


def check_checkpoint_matches(cfg: Config, kind: str, ckpt_role: str | None = None) -> None:
    """Reject a checkpoint whose model shape or kind (lm/value) disagrees with the config,
    before any process group or model exists."""
    if not cfg.checkpoint.load:
        return
    meta = read_meta(cfg.checkpoint.load)
    role = checkpoint_role(meta, ckpt_role, cfg.checkpoint.load)
    saved = meta.get("config", {}).get("model", {})
    for key in ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size"):
        want = getattr(cfg.model, key)
        if key in saved and saved[key] != want:
            raise ValueError(f"checkpoint {cfg.checkpoint.load} has model.{key}={saved[key]} "
                             f"but the config says {want}")
    saved_kind = meta["roles"][role].get("kind")
    if saved_kind and saved_kind != kind:
        raise ValueError(f"checkpoint {cfg.checkpoint.load} role '{role}' is a '{saved_kind}' "
                         f"model; asked for '{kind}'")


def run_score(cfg: Config, input_path: str, output_path: str, *, role: str,
              micro_batch_size: int, temperature: float, tokenizer=None,
              ckpt_role: str | None = None) -> None:
    check_checkpoint_matches(cfg, role, ckpt_role)
    seqs = read_sequences(input_path, tokenizer, cfg.model.vocab_size)
    layout = init_distributed(cfg)
    chunks = build_model_chunks(cfg, layout, "value" if role == "value" else "lm")
    source = load_or_init(cfg, chunks, ckpt_role)
    rows = score_sequences(cfg, layout, chunks, seqs, role=role,
                           micro_batch_size=micro_batch_size, temperature=temperature)
    if rows is not None:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        tmp = output_path + ".tmp"
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, output_path)
        print(f"scored {len(rows)} sequences ({role}) at {layout.describe()} from {source} "
              f"-> {output_path}", flush=True)
