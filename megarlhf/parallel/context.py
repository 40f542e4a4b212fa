"""Context parallelism's pieces: a sequence split along its positions over the CP group,
megatron's load-balanced way, and causal attention over the split.

**The split.** A sequence of S positions (S a multiple of 2 x CP) is cut into 2 x CP
chunks; CP rank r keeps chunks r and 2 x CP - 1 - r (megatron-core's
``get_batch_on_this_cp_rank``). Under a causal mask an early chunk attends to few keys and a
late one to many, so pairing them gives every rank the same work.

**The attention** gathers the keys and values of every CP rank (an all-gather along the
sequence, put back in position order) and lets this rank's queries attend to them under
the causal mask of their global positions. All-gather rather than a ring: one collective
per layer, the mask is the plain causal one, and it works the same over gloo and NCCL
(TransformerEngine's ``cp_comm_type="all_gather"``); the price is the whole sequence's keys
and values on every rank for one layer at a time, which with grouped-query attention is
small next to the queries' share of the activations. The backward pass sums the gradients
of the gathered keys and values over the CP ranks (a reduce-scatter).

:func:`gather_sequence` puts a per-position output (hidden states, values, log-probs)
back together on every CP rank. A loss computed from it is the same on every CP rank;
its backward hands each rank the gradient of its own positions (times CP: see
:func:`gather_sequence`), so the ranks' weight gradients are parts of the whole one that
the data-parallel reduction over DP x CP adds up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions CP rank ``rank`` keeps of a sequence of ``length`` (a multiple
    of 2 x ``cp``): chunks ``rank`` and ``2 cp - 1 - rank`` of 2 x ``cp``, in order."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x CP = "
                         f"{2 * cp} equal chunks")
    n = length // (2 * cp)
    first, second = rank * n, (2 * cp - 1 - rank) * n
    return torch.cat([torch.arange(first, first + n, device=device),
                      torch.arange(second, second + n, device=device)])


def _order(length: int, cp: int, device=None) -> torch.Tensor:
    """For the ranks' parts stacked rank after rank (cp x 2 chunks), the index of each
    global position in that stack: ``stacked.index_select(dim, _order(...))`` is the
    sequence in position order."""
    stacked = torch.cat([chunk_positions(length, cp, r, device) for r in range(cp)])
    return torch.argsort(stacked)


def local_part(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This CP rank's positions of ``x`` along ``dim`` (the whole sequence there)."""
    cp = group.size()
    if cp == 1:
        return x
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, group.rank(), x.device))


def _stack(local: torch.Tensor, group) -> torch.Tensor:
    """Every CP rank's ``local`` (its positions along dim 0) stacked rank after rank."""
    local = local.contiguous()
    out = local.new_empty((group.size() * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out


class _StackKeysValues(torch.autograd.Function):
    """:func:`_stack`; the backward sums the gradient over the CP ranks and keeps this
    rank's part (every rank's queries read every rank's keys and values)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        return _stack(local, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class _GatherSequence(torch.autograd.Function):
    """The ranks' parts along the sequence (dim 0) in position order; the backward keeps
    CP x this rank's positions' gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, local, group):
        ctx.group = group
        stacked = _stack(local, group)
        return stacked.index_select(0, _order(stacked.shape[0], group.size(), local.device))

    @staticmethod
    def backward(ctx, grad):
        return local_part(grad, 0, ctx.group) * ctx.group.size(), None


def gather_sequence(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The whole sequence of a per-position output from every CP rank's part, in position
    order, on every rank. Its backward hands this rank CP times the gradient of its own
    positions: a loss computed from the whole output is the same on every CP rank, and
    megatron's reduction over DP x CP sums the ranks' gradients and divides by a token
    count that every CP rank counted in full - so a weight used before the gather (its
    gradient from this rank's positions) and one used after it (the whole gradient on
    every CP rank) both come out right."""
    if group.size() == 1:
        return local
    return _GatherSequence.apply(local.movedim(dim, 0), group).movedim(0, dim)


def attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
              blocked: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys and
    values. ``q`` (B, heads, 2n, hd), ``k`` and ``v`` (B, groups, 2n, hd): this rank's
    positions (:func:`chunk_positions`); ``blocked``: megatron's mask of this rank's query
    rows over every key (B or 1, 1, 2n, S), True where a query may not look, or None.
    ``attend(q, k, v, allowed)`` runs the attention with SDPA's boolean mask (True = may
    attend). Returns (B, heads, 2n, hd)."""
    cp, rank = group.size(), group.rank()
    order = _order(cp * k.shape[2], cp, k.device)
    keys, values = (_StackKeysValues.apply(x.movedim(2, 0), group).index_select(0, order)
                    .movedim(0, 2) for x in (k, v))
    length = keys.shape[2]
    rows = chunk_positions(length, cp, rank, q.device)
    allowed = rows[:, None] >= torch.arange(length, device=q.device)[None, :]  # (2n, S)
    if blocked is not None:
        allowed = allowed & ~blocked
        # a query row with nothing allowed (a pad position) would give NaN: let each
        # position see itself
        allowed = allowed.clone()
        allowed[..., torch.arange(rows.numel(), device=q.device), rows] = True
    return attend(q, keys, values, allowed)
