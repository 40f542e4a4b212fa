"""``megarlhf score``: per-token log-probs (and values) of given sequences at any layout.

Input JSONL rows hold ``tokens`` (a list of ids) or ``text`` (encoded with the configured
tokenizer); ``--max-tokens`` packs them (``data.packing``) instead of padding. Output rows: ``tokens``; for ``--role lm`` ``logprobs`` and ``entropy``
(one per token after the first: the log-prob of token t+1 given tokens <= t); for
``--role value`` ``values`` (one per token).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from megarlhf.config import Config, Written
from megarlhf.data.tokenizer import fingerprint
from megarlhf.engine.forward import forward_rows
from megarlhf.roles.spec import single_role_spec
from megarlhf.roles.build import build_role
from megarlhf.data.packing import pack_prompt_response
from megarlhf.engine.steps import make_score_step, make_sequence_step
from megarlhf.parallel.launch import init_distributed, read_dist_env


def read_sequences(path: str, tokenizer=None, vocab_size: int | None = None) -> list[list[int]]:
    from megarlhf.data.datasets import text_lines

    if not os.path.exists(path):
        raise FileNotFoundError(f"input {path!r} does not exist")
    seqs = []
    for line_no, line in text_lines(path):
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
            tokens = tokenizer.encode(row["text"], add_bos=getattr(tokenizer, "add_bos", True))
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


def packed_batch(seqs: list[list[int]], kind: str) -> dict:
    """``seqs`` as one packed micro-batch (``data.packing``): the first token a one-token
    prompt, the rest the response, so the kept outputs are every position's but the last
    (LM: the log-prob of each next token) or every position's (value: the last one as
    ``last``)."""
    T = max(len(s) for s in seqs) - 1
    responses = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, seq in enumerate(seqs):
        responses[i, :len(seq) - 1] = torch.tensor(seq[1:])
        mask[i, :len(seq) - 1] = 1
    first = torch.tensor([[s[0]] for s in seqs])
    return pack_prompt_response(first, torch.ones_like(first), responses, mask, kind=kind)


def score_sequences(role, seqs: list[list[int]], *, micro_batch_size: int,
                    temperature: float = 1.0, max_tokens: int | None = None) -> list[dict]:
    """Score ``seqs`` (every rank passes the same list) with any role at its layout; every
    rank gets the rows, in order: ``logprobs`` and ``entropy`` (LM) or ``values``. Padded
    micro-batches of ``micro_batch_size`` rows, or packed ones of at most ``max_tokens``
    tokens (balanced over the data-parallel replicas by token count)."""
    kind = role.spec.kind
    kw = dict(tp_group=role.layout.tp_group, true_vocab=role.spec.model.vocab_size,
              temperature=temperature)
    if max_tokens is None:
        length = max(len(s) for s in seqs)
        results = forward_rows(role, seqs, lambda rows: right_padded_batch(rows, length),
                               make_score_step(kind, **kw), micro_batch_size=micro_batch_size)
    else:
        results = forward_rows(role, seqs, lambda rows: packed_batch(rows, kind),
                               make_sequence_step(kind, prompt_len=1, **kw),
                               micro_batch_size=1, max_tokens=max_tokens,
                               lengths=[len(s) for s in seqs])
    rows = []
    for seq, out in zip(seqs, results):
        n = len(seq)
        row = {"tokens": seq}
        if kind == "value" and max_tokens is not None:
            row["values"] = out["values"][:n - 1].tolist() + [float(out["last"])]
        elif kind == "value":
            row["values"] = out["values"][:n].tolist()
        else:
            row["logprobs"] = out["logprobs"][:n - 1].tolist()
            row["entropy"] = out["entropy"][:n - 1].tolist()
        rows.append(row)
    return rows


def run_score(cfg: Config, input_path: str, output_path: str, *, role: str,
              micro_batch_size: int, temperature: float, max_tokens: int | None = None,
              tokenizer=None,
              ckpt_role: str | None = None, written: Written | None = None) -> None:
    """``megarlhf score``: the model of ``checkpoint.load`` (or the seeded random init) at
    the configured layout; rank 0 writes the rows."""
    spec = single_role_spec(cfg, name="model", kind=role, world_size=read_dist_env().world_size,
                            trained=False, checkpoint_role=ckpt_role,
                            tokenizer=fingerprint(tokenizer) if tokenizer else None,
                            written=written)
    seqs = read_sequences(input_path, tokenizer, spec.model.vocab_size)
    longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    if len(seqs[longest]) > spec.model.max_position_embeddings:
        raise ValueError(f"{input_path}: row {longest + 1} has {len(seqs[longest])} tokens, more "
                         f"than the model's max_position_embeddings="
                         f"{spec.model.max_position_embeddings}")
    if max_tokens is not None and len(seqs[longest]) > max_tokens:
        raise ValueError(f"{input_path}: row {longest + 1} has {len(seqs[longest])} tokens, more "
                         f"than --max-tokens={max_tokens}: a packed micro-batch takes whole "
                         "sequences")
    init_distributed(cfg)
    scorer = build_role(spec, seed=cfg.run.seed)
    rows = score_sequences(scorer, seqs, micro_batch_size=micro_batch_size,
                           temperature=temperature, max_tokens=max_tokens)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
        lines = [_json_row(row, input_path) for row in rows]  # all valid, or nothing written
        tmp = output_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(tmp, output_path)
        print(f"scored {len(rows)} sequences ({role}) at {scorer.layout.describe()} from "
              f"{scorer.source} -> {output_path}", flush=True)


def _json_row(row: dict, source: str) -> str:
    """One output row; a non-finite number (damaged weights) is an error, not ``NaN`` in a
    file that then is not JSON."""
    try:
        return json.dumps(row, allow_nan=False)
    except ValueError:
        raise ValueError(f"scoring {source} gave non-finite numbers (NaN/inf) for tokens "
                         f"{row.get('tokens', [])[:8]}...: the checkpoint's weights are "
                         "probably damaged; nothing was written") from None
