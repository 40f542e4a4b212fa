"""Micro-batch construction (pure torch): right padding, sequence packing with per-sample
attention isolation, and preference pairs.

A micro-batch is a dict: ``tokens`` (B, S), ``position_ids`` (B, S), optional
``attention_mask`` (B, 1, S, S) bool with True where attention is blocked (megatron's
convention), and ``loss_mask`` (B, S) float, 1 where the *next* token's log-prob counts,
i.e. ``loss_mask[:, t]`` weighs log p(tokens[t+1] | tokens[:t+1]).
"""

from __future__ import annotations

import torch


def sft_example(prompt: list[int], response: list[int]) -> tuple[list[int], list[int]]:
    """Tokens and per-position loss weights: predict the response tokens only."""
    tokens = prompt + response
    weights = [0] * (len(prompt) - 1) + [1] * len(response) + [0]
    return tokens, weights


def pad_batch(examples: list[tuple[list[int], list[int]]], length: int,
              pad_id: int = 0) -> dict:
    """Right-padded rows; causal attention needs no mask for right padding."""
    B = len(examples)
    tokens = torch.full((B, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(B, length)
    for i, (toks, weights) in enumerate(examples):
        if len(toks) > length:
            raise ValueError(f"example of {len(toks)} tokens exceeds the batch length {length}")
        tokens[i, :len(toks)] = torch.tensor(toks)
        loss_mask[i, :len(weights)] = torch.tensor(weights, dtype=torch.float)
    positions = torch.arange(length).expand(B, -1).contiguous()
    return {"tokens": tokens, "position_ids": positions, "loss_mask": loss_mask}


def pack_examples(examples: list[tuple[list[int], list[int]]], length: int,
                  pad_id: int = 0) -> list[dict]:
    """Greedy first-fit packing into rows of ``length`` tokens. Each sample attends only to
    itself (block-diagonal causal mask) and its positions restart at 0, so a packed sample
    scores exactly as it would alone. Returns one single-row batch per packed row."""
    rows: list[list[tuple[list[int], list[int]]]] = []
    used: list[int] = []
    for toks, weights in examples:
        if len(toks) > length:
            raise ValueError(f"example of {len(toks)} tokens exceeds data.max_seq_len={length}")
        for r, n in enumerate(used):
            if n + len(toks) <= length:
                rows[r].append((toks, weights))
                used[r] += len(toks)
                break
        else:
            rows.append([(toks, weights)])
            used.append(len(toks))
    return [pack_row(row, length, pad_id) for row in rows]


def pack_row(samples: list[tuple[list[int], list[int]]], length: int, pad_id: int = 0) -> dict:
    tokens = torch.full((1, length), pad_id, dtype=torch.long)
    positions = torch.zeros(1, length, dtype=torch.long)
    loss_mask = torch.zeros(1, length)
    segment = torch.full((length,), -1, dtype=torch.long)  # -1: padding
    start = 0
    for sid, (toks, weights) in enumerate(samples):
        n = len(toks)
        tokens[0, start:start + n] = torch.tensor(toks)
        positions[0, start:start + n] = torch.arange(n)
        loss_mask[0, start:start + n] = torch.tensor(weights, dtype=torch.float)
        segment[start:start + n] = sid
        start += n
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    blocked = ~(same & causal)
    return {"tokens": tokens, "position_ids": positions, "loss_mask": loss_mask,
            "attention_mask": blocked.view(1, 1, length, length)}


def stack_batches(batches: list[dict]) -> dict:
    """Concatenate single-row (or any) batches of one length along the batch dim."""
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def preference_batch(pairs: list[tuple[list[int], list[int], list[int]]], length: int,
                     pad_id: int = 0) -> dict:
    """Rows alternate chosen, rejected of one prompt, so a pair never straddles two
    micro-batches. ``last_index`` (B,) points at each row's last real token, where the
    reward model's score is read."""
    rows = []
    for prompt, chosen, rejected in pairs:
        rows.append(prompt + chosen)
        rows.append(prompt + rejected)
    batch = pad_batch([(r, []) for r in rows], length, pad_id)
    batch["last_index"] = torch.tensor([len(r) - 1 for r in rows])
    del batch["loss_mask"]
    return batch


def batch_length(lengths: list[int], multiple: int = 8) -> int:
    """Pad to a multiple of 8: fewer distinct shapes, same results."""
    longest = max(lengths)
    return ((longest + multiple - 1) // multiple) * multiple


def prompt_response_batch(prompt_tokens_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                          response_tokens_BT: torch.Tensor, fed_mask_BT: torch.Tensor,
                          pad_id: int) -> dict:
    """Left-padded prompts + right-padded responses as one micro-batch: causal attention
    that skips padding, position ids counting real tokens, pad ids replaced, and
    ``last_index`` (B,) at each row's last real token."""
    tokens = torch.cat([prompt_tokens_BP, response_tokens_BT], dim=1)
    mask = torch.cat([prompt_mask_BP.long(), fed_mask_BT.long()], dim=1)
    S = tokens.shape[1]
    allowed = torch.ones(S, S, dtype=torch.bool).tril().view(1, 1, S, S) \
        & (mask == 1).view(-1, 1, 1, S)
    P = prompt_tokens_BP.shape[1]
    lengths = fed_mask_BT.long().sum(dim=1)
    return {"tokens": tokens.masked_fill(mask == 0, pad_id),
            "position_ids": (mask.cumsum(dim=1) - 1).clamp(min=0),
            "attention_mask": ~allowed,
            "last_index": (P + lengths - 1).clamp(min=P - 1)}
