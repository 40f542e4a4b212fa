"""Packed micro-batches (pure torch): the samples of a micro-batch concatenated into one
row with no padding, attention isolated per sample and positions restarting at each, and
token-budget micro-batches whose data-parallel shares carry balanced token counts.

A packed micro-batch is one row: ``tokens`` and ``position_ids`` (1, L) and
``cu_seqlens`` (n + 1,), the start of each sample and the end of the last. The model runs
it in megatron-core's THD format (``PackedSeqParams``, ``engine.steps.model_forward``):
rotary positions restart at each sample, and attention is causal within each sample only
- TransformerEngine's varlen kernels on GPU, one SDPA call per sample in the local layers
(``models.spec.SDPACoreAttention``), which never builds an L x L mask. A sample scores as
it would alone in a padded batch: the same tokens attend to the same tokens at the same
positions.

The outputs a loss reads are kept at ``keep`` (K,) positions only and put back in the
padded (B, T) grid of the samples' response tokens by :func:`unpack`, so every loss and
statistic is computed as for a padded micro-batch.

Bitwise: a sample's outputs do not depend on the samples packed beside it (the update at
the old policy is exactly a no-op however the updates regroup the samples). Every op is
per position or per sample except the matrix products, whose rows this machine's BLAS
computes independently of the row count from 8 rows up - but ``speedups.linears`` takes a
product of at most 64 rows the other way round, and then a row's result depends on how
many there are. So a packed row shorter than ``MIN_ROWS`` tokens is topped up with a
segment of padding, and fewer kept outputs with copies of the first (measured: a sample's
log-probs moved by 5e-7 between micro-batches of 9 and 32 kept outputs without this).
"""

from __future__ import annotations

import torch

MIN_ROWS = 65  # above speedups.linears.FEW_ROWS (tests/test_packing.py)


def balance(lengths: list[int], parts: int) -> list[list[int]]:
    """Sample indices split into ``parts`` shares with token counts as even as greedy
    allows: the longest first, each to the share with the fewest tokens so far (ties: the
    share with fewer samples, then the lower index). Every share but the heaviest was the
    lightest when the heaviest took its last sample, so the heaviest exceeds every other by
    at most one sample's length. Deterministic; indices ascend within a share. With at
    least ``parts`` samples no share is empty."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in order:
        d = min(range(parts), key=lambda p: (tokens[p], len(shares[p]), p))
        shares[d].append(i)
        tokens[d] += lengths[i]
    return [sorted(s) for s in shares]


def budget_groups(indices: list[int], lengths: list[int], budget: int, *,
                  what: str = "the micro-batch token budget") -> list[list[int]]:
    """``indices`` in micro-batches of at most ``budget`` tokens each: first-fit, longest
    first (ties: the lower index), micro-batches in the order they were opened, indices
    ascending within each. A sample longer than the budget is an error: the budget is a
    memory bound the run was configured for (``what`` names the setting)."""
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds {what}={budget}; "
                             "set it to at least the longest prompt plus response")
        for g, n in enumerate(used):
            if n + lengths[i] <= budget:
                groups[g].append(i)
                used[g] += lengths[i]
                break
        else:
            groups.append([i])
            used.append(lengths[i])
    return [sorted(g) for g in groups]


def pack_prompt_response(prompt_tokens_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                         response_tokens_BT: torch.Tensor, fed_mask_BT: torch.Tensor,
                         *, kind: str, pad_id: int = 0) -> dict:
    """The B samples of a prompt + response micro-batch (prompts left-padded, responses
    right-padded, as ``data.batching.prompt_response_batch`` takes them) packed into one
    row of their real tokens. Kept positions (``keep``) per sample: those whose outputs
    predict its response tokens (``kind="lm"``), and for a value model (``"value"``) also
    its last token's, the state after the whole response - T_b + 1 of them, the last read
    into ``last_keep`` (B,). ``unpack`` (K,) is each kept output's flat index in the (B, T)
    ``grid`` (-1: not in it); ``targets`` (1, K) the token each lm output predicts;
    ``source`` (L,) each packed token's flat index in the padded (B, P + T) prompt +
    response layout (-1: the padding segment), which maps a mixture of experts' routing
    between the two (``models.moe``)."""
    if kind not in ("lm", "value"):
        raise ValueError(f"kind must be 'lm' or 'value', got {kind!r}")
    B, T = response_tokens_BT.shape  # a row shorter than MIN_ROWS is topped up to it
    P = prompt_tokens_BP.shape[1]
    pieces, starts, keep, unpack, last_keep, source = [], [0], [], [], [], []
    for b in range(B):
        prompt = prompt_tokens_BP[b][prompt_mask_BP[b].bool()]
        cols = fed_mask_BT[b].bool().nonzero().flatten()
        source += [b * (P + T) + prompt_mask_BP[b].bool().nonzero().flatten(),
                   b * (P + T) + P + cols]
        start, p = starts[-1], len(prompt)
        if p == 0:
            raise ValueError(f"sample {b} of a packed micro-batch has an empty prompt")
        pieces += [prompt, response_tokens_BT[b, cols]]
        keep.append(start + p - 1 + torch.arange(len(cols) + (kind == "value")))
        unpack.append(b * T + cols)
        if kind == "value":
            unpack.append(torch.tensor([-1]))
            last_keep.append(sum(len(k) for k in keep) - 1)
        starts.append(start + p + len(cols))
    real = starts[-1]
    if real < MIN_ROWS:  # a segment of padding (see the module docstring)
        pieces.append(torch.full((MIN_ROWS - real,), pad_id, dtype=torch.long))
        source.append(torch.full((MIN_ROWS - real,), -1))
        starts.append(MIN_ROWS)
    tokens = torch.cat(pieces).view(1, -1)
    cu = torch.tensor(starts)
    lengths = cu[1:] - cu[:-1]
    positions = torch.arange(tokens.shape[1]) - torch.repeat_interleave(cu[:-1], lengths)
    positions[real:] = 0  # padding: inside any position table (GPT-2's learned one)
    keep, unpack = torch.cat(keep), torch.cat(unpack)
    short = max(0, MIN_ROWS - len(keep))
    keep = torch.cat([keep, keep[:1].expand(short) if len(keep) else torch.zeros(short,
                                                                              dtype=torch.long)])
    unpack = torch.cat([unpack, torch.full((short,), -1)])
    out = {"tokens": tokens, "position_ids": positions.view(1, -1), "cu_seqlens": cu,
           "keep": keep, "unpack": unpack, "grid": (B, T), "source": torch.cat(source)}
    if kind == "lm":
        out["targets"] = tokens[:, (keep + 1).clamp(max=tokens.shape[1] - 1)]
    else:
        out["last_keep"] = torch.tensor(last_keep)
    return out


def pack_rows(rows: list[list[int]], keeps: list[list[int]], *, pad_id: int = 0) -> dict:
    """Token sequences ``rows`` packed into one row, the outputs at ``keeps[b]`` (positions
    within row ``b``) kept. ``grid`` is (B, longest keep list): kept output ``j`` of row
    ``b`` lands in column ``j`` (``unpack``); ``targets`` (1, K) is the token after each
    kept position (an lm output's label; the last position's is a pad). Topped up to
    ``MIN_ROWS`` tokens and kept outputs as :func:`pack_prompt_response` is."""
    pieces, starts, keep, where = [], [0], [], []
    width = max(len(k) for k in keeps)
    for b, (row, kept) in enumerate(zip(rows, keeps)):
        if not row:
            raise ValueError(f"row {b} of a packed micro-batch is empty")
        if kept and not 0 <= min(kept) <= max(kept) < len(row):
            raise ValueError(f"row {b} of a packed micro-batch keeps positions outside its "
                             f"{len(row)} tokens")
        pieces.append(torch.as_tensor(row, dtype=torch.long))
        keep.append(starts[-1] + torch.as_tensor(kept, dtype=torch.long))
        where.append(b * width + torch.arange(len(kept)))
        starts.append(starts[-1] + len(row))
    real = starts[-1]
    if real < MIN_ROWS:  # a segment of padding (see the module docstring)
        pieces.append(torch.full((MIN_ROWS - real,), pad_id, dtype=torch.long))
        starts.append(MIN_ROWS)
    tokens = torch.cat(pieces).view(1, -1)
    cu = torch.tensor(starts)
    positions = torch.arange(tokens.shape[1]) - torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    positions[real:] = 0
    keep, where = torch.cat(keep), torch.cat(where)
    short = max(0, MIN_ROWS - len(keep))
    keep = torch.cat([keep, keep[:1].expand(short) if len(keep)
                      else torch.zeros(short, dtype=torch.long)])
    where = torch.cat([where, torch.full((short,), -1)])
    return {"tokens": tokens, "position_ids": positions.view(1, -1), "cu_seqlens": cu,
            "keep": keep, "unpack": where, "grid": (len(rows), width),
            "targets": tokens[:, (keep + 1).clamp(max=tokens.shape[1] - 1)]}


def pack_weighted(rows: list[tuple[list[int], list[float]]], *, pad_id: int = 0) -> dict:
    """SFT-style rows (tokens, ``weights[t]`` weighing the prediction of token t + 1;
    ``data.batching``) packed by :func:`pack_rows`, keeping the positions of nonzero
    weight; ``loss_mask`` (B, width) holds their weights in the ``grid``."""
    keeps = [[t for t, w in enumerate(weights[:len(tokens) - 1]) if w] for tokens, weights in rows]
    batch = pack_rows([tokens for tokens, _ in rows], keeps, pad_id=pad_id)
    mask = torch.zeros(batch["grid"])
    for b, ((_, weights), kept) in enumerate(zip(rows, keeps)):
        mask[b, :len(kept)] = torch.tensor([float(weights[t]) for t in kept])
    batch["loss_mask"] = mask
    return batch


def unpack(values_1K: torch.Tensor, batch: dict) -> torch.Tensor:
    """Kept outputs (1, K, ...) of a packed micro-batch in its padded (B, T, ...) ``grid``
    (zero where a sample has no response token). Differentiable."""
    shape, rest = batch["grid"], values_1K.shape[2:]
    flat = values_1K.new_zeros(shape[0] * shape[1], *rest)
    where = batch["unpack"] >= 0
    flat = flat.index_put((batch["unpack"][where],), values_1K[0][where])
    return flat.view(*shape, *rest)


def pad_packed(batch: dict, length: int, pad_id: int = 0) -> dict:
    """A packed micro-batch lengthened to ``length`` tokens by one more segment of
    padding (nothing reads its outputs; its position ids are 0, inside any position
    table)."""
    extra = length - batch["tokens"].shape[1]
    if extra <= 0:
        return batch
    out = dict(batch)
    out["tokens"] = torch.cat([batch["tokens"],
                               batch["tokens"].new_full((1, extra), pad_id)], dim=1)
    out["position_ids"] = torch.cat([batch["position_ids"],  # padding at position 0
                                     batch["position_ids"].new_zeros((1, extra))], dim=1)
    out["cu_seqlens"] = torch.cat([batch["cu_seqlens"], torch.tensor([length])])
    if "source" in batch:
        out["source"] = torch.cat([batch["source"], torch.full((extra,), -1)])
    if "routing" in batch:  # (1, layers, L, k): the new segment to experts 0..k-1, as
        # models.moe.unrouted routes a position whose outputs nobody reads
        r = batch["routing"]
        filler = torch.arange(r.shape[3], dtype=r.dtype).expand(1, r.shape[1], extra, -1)
        out["routing"] = torch.cat([r, filler], dim=2)
    return out


def padding_counts(batches: list[dict], real_tokens: int) -> tuple[int, int]:
    """(padding positions, computed positions) of ``batches`` holding ``real_tokens``."""
    computed = sum(int(b["tokens"].numel()) for b in batches)
    return computed - real_tokens, computed
