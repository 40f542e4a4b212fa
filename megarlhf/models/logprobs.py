"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full
vocabulary onto one rank.

megatron's ``vocab_parallel_cross_entropy`` reads the TP group from its global state;
roles in an inference layout have their own group, so this module takes the group
explicitly. It follows megatron's algorithm (global max, then summed exp) and also
returns the entropy, which PPO logs and may add as a bonus.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

_MASKED = -1e30  # finite, so 0 * log p stays 0 in the entropy


def mask_padded_vocab(logits_BTV: torch.Tensor, true_vocab: int, tp_group) -> torch.Tensor:
    """Set logits of vocabulary padding rows (ids >= ``true_vocab``) to a large negative."""
    shard = logits_BTV.shape[-1]
    start = shard * (tp_group.rank() if tp_group is not None else 0)
    first_pad = true_vocab - start
    if first_pad >= shard:
        return logits_BTV
    # a copy and a fill of the padding columns: a masked_fill with an (V,) mask
    # broadcast over (B, T) took 17x as long as the copy (8 x 32 x 4096 logits)
    out = logits_BTV.clone()
    out[..., max(first_pad, 0):] = _MASKED
    return out


def _shift_and_localize(logits, ids, group):
    """Logits minus their global max (over the TP group), the world size, and ``ids`` as
    indices into this rank's shard with a mask of the ids that live elsewhere (index 0)."""
    world = 1 if group is None else group.size()
    rank = 0 if group is None else group.rank()
    logits_max = logits.max(dim=-1).values
    if world > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shard = logits.shape[-1]
    local = ids - rank * shard
    elsewhere = (local < 0) | (local >= shard)
    return logits - logits_max.unsqueeze(-1), world, local.masked_fill(elsewhere, 0), elsewhere


def _scaled(logits_BTV, temperature: float, true_vocab: int | None, tp_group):
    """fp32 logits / temperature with the vocabulary padding masked out."""
    logits = logits_BTV.float()
    if temperature != 1.0:
        logits = logits / temperature
    if true_vocab is not None:
        logits = mask_padded_vocab(logits, true_vocab, tp_group)
    return logits


CHUNK_TOKENS = 4096
"""Positions whose log-probs are computed at once: the fp32 copies of the logits, the
softmax and its log exist for one chunk at a time, forward and backward."""


def _parts(logits, target, group):
    """(log-prob of the target, entropy, probabilities, log-probabilities, the targets on
    another rank's shard, the targets as local indices) of fp32 ``logits``. On one rank:
    torch's fused ``log_softmax``; over a TP group: megatron's algorithm (global max,
    summed exp)."""
    world = 1 if group is None else group.size()
    if world == 1:
        shard = logits.shape[-1]
        target_mask = (target < 0) | (target >= shard)
        local_target = target.masked_fill(target_mask, 0)
        log_p = torch.log_softmax(logits, dim=-1)
        probs = log_p.exp()
        logprob = log_p.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        # an id outside the vocabulary: -log Z, as the TP path gives an id no rank holds
        # (a where, not a branch on target_mask.any(): no host sync on a GPU)
        logprob = torch.where(target_mask, log_p[..., 0] - logits[..., 0], logprob)
        entropy = -torch.linalg.vecdot(probs, log_p)
        return logprob, entropy, probs, log_p, target_mask, local_target
    shifted, world, local_target, target_mask = _shift_and_localize(logits, target, group)
    predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    predicted = predicted.masked_fill(target_mask, 0.0)
    exp_logits = shifted.exp()
    sums = torch.stack([predicted, exp_logits.sum(-1), (exp_logits * shifted).sum(-1)])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    predicted, sum_exp, sum_exp_z = sums.unbind(0)
    log_z = torch.log(sum_exp)
    logprob = predicted - log_z
    entropy = log_z - sum_exp_z / sum_exp
    probs = exp_logits.div_(sum_exp.unsqueeze(-1))
    log_p = shifted.sub_(log_z.unsqueeze(-1))
    return logprob, entropy, probs, log_p, target_mask, local_target


def _spans(length: int, rows: int, chunk: int) -> list[slice]:
    """Slices of the position dimension, about ``chunk`` positions (of all ``rows``) each."""
    step = max(1, chunk // max(rows, 1))
    return [slice(s, min(s + step, length)) for s in range(0, length, step)]


class _VocabParallelLogprob(torch.autograd.Function):
    """(log-prob of the target, entropy) per position from this rank's shard of the raw
    logits, a chunk of positions at a time (``CHUNK_TOKENS``): the fp32 logits / temperature
    with the padding masked, the softmax and its log exist for one chunk, and only the raw
    logits are kept for the backward pass, which computes them again chunk by chunk. The
    gradient is written in two passes over a chunk, one when the entropy takes no gradient
    (its usual case: logged, not in the loss). The same arithmetic as on the whole tensor
    at once, position by position: the values and gradients are the same."""

    @staticmethod
    def forward(ctx, logits, target, group, temperature, true_vocab, chunk):
        ctx.set_materialize_grads(False)
        B, T = target.shape
        outs = [_parts(_scaled(logits[:, s], temperature, true_vocab, group), target[:, s],
                       group)[:2] for s in _spans(T, B, chunk)]
        empty = logits.new_zeros((B, 0), dtype=torch.float32)
        logprob = torch.cat([o[0] for o in outs], dim=1) if outs else empty
        entropy = torch.cat([o[1] for o in outs], dim=1) if outs else empty
        ctx.save_for_backward(logits, target, entropy)
        ctx.group, ctx.temperature, ctx.true_vocab, ctx.chunk = group, temperature, \
            true_vocab, chunk
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        # d logprob / dz_i = onehot_i - p_i ;  d H / dz_i = -p_i (log p_i + H), so
        # grad_i = g_lp onehot_i + p_i (-(g_lp + g_H H) - g_H log p_i)
        logits, target, entropy = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None
        B, T = target.shape
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for s in _spans(T, B, ctx.chunk):
            out[:, s] = _chunk_grad(ctx, logits[:, s], target[:, s], grad_logprob, grad_entropy,
                                    entropy, s)
        return out, None, None, None, None, None


def _chunk_grad(ctx, logits, target, grad_logprob, grad_entropy, entropy, s):
    """The gradient of (log-prob, entropy) in one chunk ``s`` of positions of the raw
    ``logits`` (fp32; see :class:`_VocabParallelLogprob`)."""
    group, temperature, true_vocab = ctx.group, ctx.temperature, ctx.true_vocab
    scaled = _scaled(logits, temperature, true_vocab, group)
    _, _, probs, log_p, target_mask, local_target = _parts(scaled, target, group)
    g_lp = None if grad_logprob is None else grad_logprob[:, s]
    if grad_entropy is None:
        grad = probs * (-g_lp).unsqueeze(-1)
    else:
        coef = -grad_entropy[:, s] * entropy[:, s]
        if g_lp is not None:
            coef = coef - g_lp
        grad = torch.addcmul(coef.unsqueeze(-1), log_p, -grad_entropy[:, s].unsqueeze(-1))
        grad.mul_(probs)
    if g_lp is not None:
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        hit = (~target_mask).view(-1).to(flat.dtype)
        flat[rows, local_target.reshape(-1)] += hit * g_lp.reshape(-1)
    return _unscaled_grad(grad, temperature, true_vocab, group)


def _head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head's logits ``hidden @ weight^T`` as one 2-D matmul. The head's input is a
    slice of the model's (B, S, H) output (``[:, :-1]``, a chunk of positions), often of
    a transposed (S, B, H) tensor; ``F.linear`` may run such a slice as a batched matmul
    over a copy of the weight per row (measured 1.6-2x slower at the bench's medium
    size) instead of copying the slice."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    return F.linear(rows, weight).view(*hidden.shape[:-1], weight.shape[0])


class _HeadLogprob(torch.autograd.Function):
    """(log-prob of the target, entropy) per position from the hidden states the LM head
    reads and this rank's shard of the head's weight, a chunk of positions at a time: the
    logits exist for one chunk, forward and backward (which computes them again), so the
    head's memory is one chunk's, not positions x vocabulary. Returns the gradient of the
    hidden states this rank's shard gives (the caller sums them over TP) and of the
    weight. Per chunk the arithmetic of the head's matmul and :class:`_VocabParallelLogprob`.
    Positions that fit in one chunk keep their logits (in the model's dtype) for the
    backward pass instead of computing them again: one chunk's memory, no second matmul."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, temperature, true_vocab, chunk):
        ctx.set_materialize_grads(False)
        B, T = target.shape
        spans = _spans(T, B, chunk)
        kept = _head(hidden, weight) if len(spans) == 1 else None
        outs = [_parts(_scaled(_head(hidden[:, s], weight) if kept is None else kept,
                               temperature, true_vocab, group),
                       target[:, s], group)[:2] for s in spans]
        empty = hidden.new_zeros((B, 0), dtype=torch.float32)
        logprob = torch.cat([o[0] for o in outs], dim=1) if outs else empty
        entropy = torch.cat([o[1] for o in outs], dim=1) if outs else empty
        ctx.save_for_backward(hidden, weight, target, entropy,
                              *([kept] if kept is not None else []))
        ctx.group, ctx.temperature, ctx.true_vocab, ctx.chunk = group, temperature, \
            true_vocab, chunk
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, target, entropy, *kept = ctx.saved_tensors
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        B, T = target.shape
        grad_hidden = torch.empty_like(hidden)
        # a frozen head (LoRA) needs no weight gradient: the largest matmul of the backward
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in _spans(T, B, ctx.chunk):
            part = hidden[:, s]
            logits = kept[0] if kept else _head(part, weight)
            grad = _chunk_grad(ctx, logits, target[:, s], grad_logprob, grad_entropy, entropy,
                               s).to(logits.dtype)
            grad_hidden[:, s] = grad @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.reshape(-1, grad.shape[-1]).t(),
                                   part.reshape(-1, part.shape[-1]))
        return grad_hidden, grad_weight, None, None, None, None, None


def _unscaled_grad(grad, temperature: float, true_vocab: int | None, tp_group):
    """The gradient through :func:`_scaled`: none to the masked padding columns, divided by
    the temperature (in that order, as autograd would take it)."""
    if true_vocab is not None:
        shard = grad.shape[-1]
        start = shard * (tp_group.rank() if tp_group is not None else 0)
        first_pad = true_vocab - start
        if first_pad < shard:
            grad[..., max(first_pad, 0):] = 0.0
    if temperature != 1.0:
        grad = grad / temperature
    return grad


def vocab_parallel_logprobs(logits_BTV: torch.Tensor, target_BT: torch.Tensor, *,
                            tp_group=None, temperature: float = 1.0,
                            true_vocab: int | None = None, chunk: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy under softmax(logits / temperature).

    ``logits_BTV`` is this rank's vocabulary shard (B, T, V/tp); returns two fp32
    (B, T) tensors, identical on every TP rank. Differentiable in the logits, of which it
    keeps only the tensor given (no fp32 copy, softmax or log-softmax of all positions:
    those exist ``chunk`` positions at a time; default ``CHUNK_TOKENS``).
    """
    return _VocabParallelLogprob.apply(logits_BTV, target_BT, tp_group, temperature,
                                       true_vocab, chunk or CHUNK_TOKENS)


def head_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, target_BT: torch.Tensor,
                  *, tp_group=None, temperature: float = 1.0, true_vocab: int | None = None,
                  chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logprobs` of the logits ``hidden_BTH @ weight_VH^T`` (the LM
    head: this rank's (V/tp, H) shard of its weight) without making them: ``chunk``
    positions at a time, forward and backward. ``hidden_BTH`` is the head's input, whole
    on every TP rank (``models.gpt.RoleModel``'s deferred head hands it over with its
    gradient summed over TP)."""
    return _HeadLogprob.apply(hidden_BTH, weight_VH, target_BT, tp_group, temperature,
                              true_vocab, chunk or CHUNK_TOKENS)


@torch.no_grad()
def vocab_parallel_topk(logits_BTV: torch.Tensor, k: int, *, tp_group=None,
                        temperature: float = 1.0, true_vocab: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens per position under softmax(logits / temperature):
    (B, T, k) fp32 log-probs and (B, T, k) int64 global token ids, identical on every TP
    rank. Each rank offers its shard's top k; the TP group keeps the best k of those."""
    logits = _scaled(logits_BTV, temperature, true_vocab, tp_group)
    world = 1 if tp_group is None else tp_group.size()
    rank = 0 if tp_group is None else tp_group.rank()
    shard = logits.shape[-1]
    values, ids = logits.topk(min(k, shard), dim=-1)
    ids = ids + rank * shard
    log_z = torch.logsumexp(logits, dim=-1)
    if world > 1:
        gathered_values = [torch.empty_like(values) for _ in range(world)]
        gathered_ids = [torch.empty_like(ids) for _ in range(world)]
        all_z = [torch.empty_like(log_z) for _ in range(world)]
        dist.all_gather(gathered_values, values.contiguous(), group=tp_group)
        dist.all_gather(gathered_ids, ids.contiguous(), group=tp_group)
        dist.all_gather(all_z, log_z.contiguous(), group=tp_group)
        values, order = torch.cat(gathered_values, -1).topk(k, dim=-1)
        ids = torch.cat(gathered_ids, -1).gather(-1, order)
        log_z = torch.logsumexp(torch.stack(all_z), dim=0)
    return values - log_z.unsqueeze(-1), ids


class _VocabParallelGather(torch.autograd.Function):
    """Log-probs of several token ids per position, (B, T, K), from vocab-parallel logits."""

    @staticmethod
    def forward(ctx, logits, ids, group):
        logprobs, probs, local, off = _gather_parts(logits, ids, group)
        ctx.save_for_backward(probs, off, local)
        return logprobs

    @staticmethod
    def backward(ctx, grad_out):
        probs, off, local = ctx.saved_tensors
        # d logp_j / dz_i = [i == id_j] - p_i
        grad = -probs * grad_out.sum(-1, keepdim=True)
        grad.scatter_add_(-1, local, grad_out.masked_fill(off, 0.0))
        return grad, None, None


def _gather_parts(logits, ids, group):
    """(log-probs of the global ``ids`` (B, T, K), probabilities, the ids as local indices,
    the ids on another rank's shard) of fp32 ``logits``, over the TP group."""
    shifted, world, local, off = _shift_and_localize(logits, ids, group)
    picked = shifted.gather(-1, local).masked_fill(off, 0.0)
    exp_logits = shifted.exp()
    sum_exp = exp_logits.sum(-1)
    if world > 1:
        dist.all_reduce(picked, group=group)
        dist.all_reduce(sum_exp, group=group)
    log_z = torch.log(sum_exp)
    return picked - log_z.unsqueeze(-1), exp_logits.div_(sum_exp.unsqueeze(-1)), local, off


class _HeadGather(torch.autograd.Function):
    """(B, T, K) log-probs of the ids ``ids`` from the LM head's input and this rank's
    shard of its weight, a chunk of positions at a time, as :class:`_HeadLogprob` takes
    (log-prob, entropy): the logits exist for one chunk, forward and backward (which makes
    them again), but for positions that fit one chunk, which keep theirs. Per chunk the
    arithmetic of the head's matmul and :func:`vocab_parallel_gather_logprobs`."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, group, temperature, true_vocab, chunk):
        B, T, _ = ids.shape
        spans = _spans(T, B, chunk)
        kept = _head(hidden, weight) if len(spans) == 1 else None
        outs = [_gather_parts(_scaled(_head(hidden[:, s], weight) if kept is None else kept,
                                      temperature, true_vocab, group), ids[:, s], group)[0]
                for s in spans]
        ctx.save_for_backward(hidden, weight, ids, *([kept] if kept is not None else []))
        ctx.group, ctx.temperature, ctx.true_vocab, ctx.chunk = group, temperature, \
            true_vocab, chunk
        return torch.cat(outs, dim=1) if outs else hidden.new_zeros((B, 0, ids.shape[-1]))

    @staticmethod
    def backward(ctx, grad_out):
        # d logp_j / dz_i = [i == id_j] - p_i
        hidden, weight, ids, *kept = ctx.saved_tensors
        B, T, _ = ids.shape
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        for s in _spans(T, B, ctx.chunk):
            part = hidden[:, s]
            logits = kept[0] if kept else _head(part, weight)
            scaled = _scaled(logits, ctx.temperature, ctx.true_vocab, ctx.group)
            _, probs, local, off = _gather_parts(scaled, ids[:, s], ctx.group)
            g = grad_out[:, s]
            grad = probs.mul_(-g.sum(-1, keepdim=True))
            grad.scatter_add_(-1, local, g.masked_fill(off, 0.0))
            grad = _unscaled_grad(grad, ctx.temperature, ctx.true_vocab,
                                  ctx.group).to(logits.dtype)
            grad_hidden[:, s] = grad @ weight
            grad_weight.addmm_(grad.reshape(-1, grad.shape[-1]).t(),
                               part.reshape(-1, part.shape[-1]))
        return grad_hidden, grad_weight, None, None, None, None, None


def head_gather_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor,
                         ids_BTK: torch.Tensor, *, tp_group=None, temperature: float = 1.0,
                         true_vocab: int | None = None, chunk: int | None = None
                         ) -> torch.Tensor:
    """:func:`vocab_parallel_gather_logprobs` of the logits ``hidden_BTH @ weight_VH^T``
    without making them but ``chunk`` positions at a time (as :func:`head_logprobs`)."""
    return _HeadGather.apply(hidden_BTH, weight_VH, ids_BTK, tp_group, temperature,
                             true_vocab, chunk or CHUNK_TOKENS)


def vocab_parallel_gather_logprobs(logits_BTV: torch.Tensor, ids_BTK: torch.Tensor, *,
                                   tp_group=None, temperature: float = 1.0,
                                   true_vocab: int | None = None) -> torch.Tensor:
    """(B, T, K) fp32 log-probs of the global token ids ``ids_BTK`` under softmax(logits /
    temperature), differentiable in the logits; identical on every TP rank."""
    logits = _scaled(logits_BTV, temperature, true_vocab, tp_group)
    return _VocabParallelGather.apply(logits, ids_BTK, tp_group)
