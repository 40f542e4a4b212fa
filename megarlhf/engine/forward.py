"""The one forward-only path: rows through any role at its own layout, per-row results on
every rank. ``megarlhf score``, reward normalisation and experience making all use it."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megarlhf.engine.schedule import forward_only
from megarlhf.parallel import cpu_backend
from megarlhf.parallel.gather import gather_objects
from megarlhf.parallel import watchdog


def forward_rows(role, rows: Sequence[Any], make_batch: Callable[[list[Any]], dict],
                 forward_step: Callable, *, micro_batch_size: int,
                 gather: bool = True) -> list[dict] | dict[int, dict]:
    """Score ``rows`` (every rank passes the same list) with ``role`` - any role at any
    TP/PP/VPP/DP layout - and return, on every rank, one dict of tensors per row.

    Data-parallel replica ``d`` takes rows ``d::DP``. Pipeline stages exchange fixed-shape
    activations, so ``make_batch`` must pad every micro-batch to one length, and the last
    micro-batch is topped up with copies of a row whose results are dropped.
    ``forward_step``'s loss function returns a dict of per-row tensors ``(B, ...)``; the
    last stage's TP rank 0 of each replica reports them and every rank receives all rows.
    With ``gather=False`` nothing is exchanged: the reporting rank of each replica gets
    ``{row index: result}`` for its own rows (others an empty dict) - what a cache writer
    that shards by owner needs.
    """
    with watchdog.phase(f"forward pass of the {role.spec.name}"):
        return _forward_rows(role, rows, make_batch, forward_step,
                             micro_batch_size=micro_batch_size, gather=gather)


def _forward_rows(role, rows, make_batch, forward_step, *, micro_batch_size: int,
                  gather: bool):
    layout = role.layout
    mine = list(range(layout.dp_rank, len(rows), layout.dp))
    local: dict[int, dict] = {}
    if mine:
        padded = mine + [mine[0]] * (-len(mine) % micro_batch_size)
        groups = [padded[k:k + micro_batch_size]
                  for k in range(0, len(padded), micro_batch_size)]
        with cpu_backend.suspended():  # batching and results: no megatron code
            batches = [make_batch([rows[i] for i in idx]) for idx in groups]
        for chunk in role.chunks:
            if chunk.training:  # as engine.optimizer.forward_backward
                chunk.eval()
        outs = forward_only(role.chunks, forward_step, batches, layout=layout,
                            seq_length=batches[0]["tokens"].shape[1],
                            micro_batch_size=micro_batch_size)
        if layout.writes_results:
            seen = set()
            with cpu_backend.suspended():
                for idx, out in zip(groups, outs):
                    for b, i in enumerate(idx):
                        if i not in seen:  # the top-up copies come last
                            seen.add(i)
                            local[i] = {key: value[b].detach().cpu()
                                        for key, value in out.items()}
    if not gather:
        return local
    merged: dict[int, dict] = {}
    for part in gather_objects(local):
        merged.update(part)
    assert sorted(merged) == list(range(len(rows))), "forward_rows lost rows"
    return [merged[i] for i in range(len(rows))]


def stack_results(results: list[dict], key: str) -> torch.Tensor:
    """One field of :func:`forward_rows`' results as a batch tensor."""
    return torch.stack([r[key] for r in results])
