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


def packed_split(cu_seqlens: list[int], cp: int, step: int
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """A packed row of samples bounded by ``cu_seqlens``, each lengthened to a multiple
    of ``step`` (2 x CP, times TP under sequence parallelism) with its padding after it:
    (where each position of the row goes in the lengthened row, each CP rank's positions
    of the lengthened row - its two chunks of every sample - and the lengthened row's
    sample bounds)."""
    sizes = [-(-(b - a) // step) * step for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    place = torch.cat([torch.arange(a, b) - a + s
                       for a, b, s in zip(cu_seqlens[:-1], cu_seqlens[1:], starts)])
    parts = [torch.cat([chunk_positions(n, cp, r) + s for n, s in zip(sizes, starts)])
             for r in range(cp)]
    return place, parts, [*starts, sum(sizes)]


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
    """The ranks' parts along dim 0 put in position order: ``stacked`` gives the position
    of each element of the parts stacked rank after rank. The backward keeps CP x this
    rank's positions' gradient (see :func:`gather_sequence`)."""

    @staticmethod
    def forward(ctx, local, group, stacked):
        ctx.group = group
        ctx.own = stacked[group.rank() * local.shape[0]:(group.rank() + 1) * local.shape[0]]
        return _stack(local, group).index_select(0, torch.argsort(stacked))

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.own) * ctx.group.size(), None, None


def gather_sequence(local: torch.Tensor, dim: int, group,
                    stacked: torch.Tensor | None = None) -> torch.Tensor:
    """The whole sequence of a per-position output from every CP rank's part, in position
    order, on every rank. ``stacked``: the position of each element of the ranks' parts
    stacked rank after rank (default: :func:`chunk_positions`' split of one sequence).

    Its backward hands this rank CP times the gradient of its own positions: a loss
    computed from the whole output is the same on every CP rank, and megatron's reduction
    over DP x CP sums the ranks' gradients and divides by a token count that every CP rank
    counted in full - so a weight used before the gather (its gradient from this rank's
    positions) and one used after it (the whole gradient on every CP rank) both come out
    right."""
    cp = group.size()
    if cp == 1:
        return local
    if stacked is None:
        length = cp * local.shape[dim]
        stacked = torch.cat([chunk_positions(length, cp, r, local.device) for r in range(cp)])
    return _GatherSequence.apply(local.movedim(dim, 0), group, stacked).movedim(0, dim)


def attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
              blocked: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys and
    values. ``q`` (B, heads, 2n, hd), ``k`` and ``v`` (B, groups, 2n, hd): this rank's
    positions (:func:`chunk_positions`); ``blocked``: megatron's mask of this rank's query
    rows over every key (B or 1, 1, 2n, S), True where a query may not look, or None (then
    each chunk of queries attends to the keys before it under a lower-right causal mask
    that the kernels take without making it). ``attend(q, k, v, allowed)`` runs the
    attention with SDPA's ``attn_mask`` (a boolean mask, True = may attend, or torch's
    causal bias). Returns (B, heads, 2n, hd)."""
    cp, rank = group.size(), group.rank()
    order = _order(cp * k.shape[2], cp, k.device)
    keys, values = (_StackKeysValues.apply(x.movedim(2, 0), group).index_select(0, order)
                    .movedim(0, 2) for x in (k, v))
    length = keys.shape[2]
    if blocked is None:
        return torch.cat(_by_chunk(attend, q, keys, values, 2, rank, cp), dim=2)
    rows = chunk_positions(length, cp, rank, q.device)
    allowed = (rows[:, None] >= torch.arange(length, device=q.device)[None, :]) & ~blocked
    # a query row with nothing allowed (a pad position) would give NaN: let each position
    # see itself
    allowed[..., torch.arange(rows.numel(), device=q.device), rows] = True
    return attend(q, keys, values, allowed)


def attention_packed(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: list[int], group) -> torch.Tensor:
    """:func:`attention` over a packed row (megatron's THD format under CP): ``q`` (t,
    heads, hd), ``k`` and ``v`` (t, groups, hd) hold this rank's part of each sample back
    to back, ``cu_seqlens`` the samples' bounds in the whole row (each sample a multiple of
    2 x CP positions, and this rank's part of it 1/CP of them). Causal attention within
    each sample. Returns (t, heads, hd)."""
    cp, rank = group.size(), group.rank()
    local = q.shape[0]
    keys, values = (_StackKeysValues.apply(x, group) for x in (k, v))  # (cp x t, ...)
    outs = []
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        length, first, last = stop - start, start // cp, stop // cp
        order = _order(length, cp, q.device)
        k_i, v_i = (torch.cat([x[r * local + first:r * local + last] for r in range(cp)])
                    .index_select(0, order) for x in (keys, values))
        parts = _by_chunk(attend, q[first:last].transpose(0, 1)[None],
                          k_i.transpose(0, 1)[None], v_i.transpose(0, 1)[None], 2, rank, cp)
        outs += [out[0].transpose(0, 1) for out in parts]  # (1, heads, n, hd) each
    return torch.cat(outs)


def _by_chunk(attend, q, keys, values, dim: int, rank: int, cp: int) -> list[torch.Tensor]:
    """This rank's two chunks of queries (along ``dim``), each over the keys up to its
    own last position under a causal mask aligned to the lower right: torch's
    ``causal_lower_right`` bias, which the GPU kernels apply without making the mask (on
    the CPU torch makes it, and its attention keeps it for the backward pass)."""
    from torch.nn.attention.bias import causal_lower_right

    n = q.shape[dim] // 2
    outs = []
    for j, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * n
        outs.append(attend(q.narrow(dim, j * n, n), keys.narrow(dim, 0, end),
                           values.narrow(dim, 0, end), causal_lower_right(n, end)))
    return outs
