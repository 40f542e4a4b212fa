"""The one forward-only path: rows through any role at its own layout, per-row results on
every rank. ``megarlhf score``, reward normalisation and experience making all use it."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megarlhf.data.packing import budget_groups, padding_counts
from megarlhf.engine.schedule import forward_only
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel import watchdog


def forward_rows(role, rows: Sequence[Any], make_batch: Callable[[list[Any]], dict],
                 forward_step: Callable, *, micro_batch_size: int,
                 gather: bool = True, max_tokens: int | None = None,
                 lengths: Sequence[int] | None = None,
                 padding: dict | None = None) -> list[dict] | dict[int, dict]:
    """Score ``rows`` (every rank passes the same list) with ``role`` - any role at any
    TP/PP/VPP/DP layout - and return, on every rank, one dict of tensors per row.

    Padded (``max_tokens`` None): data-parallel replica ``d`` takes rows ``d::DP`` in
    micro-batches of ``micro_batch_size``, the last topped up with copies of a row whose
    results are dropped; ``make_batch`` pads a micro-batch. Packed (``max_tokens``, with
    the rows' token counts in ``lengths``): the replicas take shares of balanced token
    counts (``data.packing.balance``), cut into micro-batches of at most ``max_tokens``
    tokens; ``make_batch`` packs one. Pipeline stages exchange the shapes when they vary.

    ``forward_step``'s loss function returns a dict of per-row tensors ``(B, ...)``; the
    last stage's TP rank 0 of each replica reports them and every rank receives all rows.
    With ``gather=False`` nothing is exchanged: the reporting rank of each replica gets
    ``{row index: result}`` for its own rows (others an empty dict) - what a cache writer
    that shards by owner needs. ``padding`` (with ``lengths``, and ``gather``) receives the
    pass's token positions summed over the replicas: ``computed`` and ``padding``.
    """
    with watchdog.phase(f"forward pass of the {role.spec.name}"):
        return _forward_rows(role, rows, make_batch, forward_step,
                             micro_batch_size=micro_batch_size, gather=gather,
                             max_tokens=max_tokens, lengths=lengths, padding=padding)


def _forward_rows(role, rows, make_batch, forward_step, *, micro_batch_size: int,
                  gather: bool, max_tokens: int | None, lengths, padding: dict | None):
    layout = role.layout
    if max_tokens is not None:
        if lengths is None:
            raise ValueError("forward_rows: packed micro-batches need the rows' lengths")
        mine = layout.balanced_share(list(lengths))
        groups = budget_groups(mine, list(lengths), max_tokens)
        micro_batch_size = 1  # one packed row per micro-batch
    else:
        mine = layout.strided_share(len(rows))
        padded = mine + [mine[0]] * (-len(mine) % micro_batch_size) if mine else []
        groups = [padded[k:k + micro_batch_size]
                  for k in range(0, len(padded), micro_batch_size)]
    local: dict[int, dict] = {}
    counts = (0, 0)
    batches = [make_batch([rows[i] for i in idx]) for idx in groups] if mine else []
    if mine and lengths is not None and layout.writes_results:
        counts = padding_counts(batches, sum(lengths[i] for i in mine))
    for chunk in role.chunks:
        if chunk.training:  # as engine.optimizer.forward_backward
            chunk.eval()
    # every rank enters the schedule: under expert parallelism the ranks agree there on
    # their number of micro-batches (engine.schedule)
    outs = forward_only(role.chunks, forward_step, batches, layout=layout,
                        seq_length=max((b["tokens"].shape[1] for b in batches), default=0),
                        micro_batch_size=micro_batch_size)
    if mine and layout.writes_results:
        seen = set()
        for idx, out in zip(groups, outs):
            for b, i in enumerate(idx):
                if i not in seen:  # the top-up copies come last
                    seen.add(i)
                    local[i] = {key: value[b].detach().cpu()
                                for key, value in out.items()}
    if not gather:
        return local
    merged: dict[int, dict] = {}
    for part, (pad, computed) in gather_objects((local, counts)):
        merged.update(part)
        if padding is not None:
            padding["padding"] = padding.get("padding", 0) + pad
            padding["computed"] = padding.get("computed", 0) + computed
    assert sorted(merged) == list(range(len(rows))), "forward_rows lost rows"
    return [merged[i] for i in range(len(rows))]


def stack_results(results: list[dict], key: str) -> torch.Tensor:
    """One field of :func:`forward_rows`' results as a batch tensor."""
    return torch.stack([r[key] for r in results])
