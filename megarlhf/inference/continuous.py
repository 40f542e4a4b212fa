"""Continuous batching: at most ``slots`` rows decode at once, and a row that stops hands
its slot to the next waiting prompt at the next step (``rollout.decode_slots``).

A static batch feeds every row until the longest one stops: with long-tailed responses
half of the rows fed at the decode steps have already stopped (``rollout/idle_decode_slots``).
Here a freed slot takes the next prompt in order, so the prompts of a GRPO group, which
are adjacent, start together. One megatron ``StaticInferenceContext`` of ``slots`` rows
holds the keys and values; its columns are shared, so a prompt admitted at decode column
c is written into its slot's columns ending at c (the columns before it, the previous
occupant's, are masked out of its attention; positions count its own tokens). The context
is as long as the longest schedule could need: the longest prompt plus ``max_new_tokens``
times (prompts / slots + 1).

Samples are those of :func:`~megarlhf.inference.generate.generate` for the same per-prompt
seeds (greedy, or ``row_seeds``: each prompt draws its own stream, one draw per token it
samples), whichever slot and step a prompt gets; the logits of a row can differ in the
last bits with the batch it is computed in.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megarlhf import speedups
from megarlhf.models import moe
from megarlhf.models.gpt import unwrap
from megarlhf.inference.kv_cache import kv_cache_bytes
from megarlhf.speedups.shared_prefill import copy as copy_prefill
from megarlhf.speedups.shared_prefill import groups as prefill_groups
from megarlhf.speedups.shared_prefill import spread as spread_prefill
from megarlhf.inference.generate import (Generation, SamplingParams, SeededDraws,
                                        _attention_blocked, left_pad, sample_next,
                                        stop_tensor)


@torch.no_grad()
def generate_continuous(model, prompts: list[list[int]], params: SamplingParams, *,
                        slots: int, eos_id: int, pad_id: int, true_vocab: int,
                        row_seeds: list[int] | None = None,
                        stats: dict | None = None, interrupt: Callable[[], bool] | None = None,
                        recompute_kv: bool = True, record_routing: bool = False,
                        shared_prefill: bool | None = None) -> Generation:
    """As :func:`~megarlhf.inference.generate.generate` (greedy or ``row_seeds``), decoding
    at most ``slots`` rows at a time. ``stats``: ``kv_cache_bytes``, ``decode_slots`` (the
    slots of every decode step) and ``idle_decode_slots`` (those without a row: only once
    no prompt waits), ``shared_prefills`` (prompts whose prefill was copied). ``interrupt``
    and ``recompute_kv``: as ``generate``'s (a recompute feeds every slot's columns
    again). ``shared_prefill`` (None: where the speed-up is
    on): the first slots' repeated prompts prefill once, and a prompt admitted at the
    same step as its twin copies the twin's keys and values. ``record_routing``: a mixture
    of experts' choices for every token fed, in ``routing_BLSK`` laid out as ``generate``'s
    (the left-padded prompts' P columns, then the response's)."""
    if shared_prefill is None:
        shared_prefill = speedups.enabled("shared_prefill")
    shared_prefill = shared_prefill and not record_routing  # (a routing record per slot)
    if not params.greedy and row_seeds is None:
        raise ValueError("continuous batching samples with per-prompt seeds (row_seeds) or "
                         "greedily: a shared generator's draws would depend on the schedule")
    device = next(model.parameters()).device
    n, T = len(prompts), params.max_new_tokens
    S = min(slots, n)
    P = max(len(p) for p in prompts)
    # every column the longest schedule could reach: while prompts wait, all S slots
    # sample, so at most n * T / S steps; then at most T more
    L = P + T * (-(-n // S) + 1)
    stops = stop_tensor(params, eos_id, device)
    tokens = torch.full((S, L), pad_id, dtype=torch.long, device=device)
    key_mask = torch.zeros(S, L, dtype=torch.long, device=device)
    positions = torch.zeros(S, L, dtype=torch.long, device=device)
    ctx = StaticInferenceContext(S, L)
    config = unwrap(model).config
    routing = moe.unrouted(n, config.num_layers, P + T, config.moe_router_topk or 1) \
        if record_routing else None
    # each slot's cache column -> the output column of its prompt's token there (-1: none)
    where = torch.full((S, L), -1, dtype=torch.long)
    draws = SeededDraws(row_seeds, true_vocab, device) if row_seeds else None
    holds = [-1] * S  # the prompt each slot decodes (-1: none)
    length = [0] * S  # tokens the slot's prompt has sampled
    out = Sampled(n, T)
    swaps = 0

    def forward(rows: slice, start: int, end: int) -> torch.Tensor:
        """Feed columns [start, end) of ``rows``; logits at column end - 1."""
        ctx.batch_size_offset, ctx.sequence_len_offset = rows.start, start
        blocked = _attention_blocked(key_mask[rows, :end], end - start)
        with moe.recording(model) if routing is not None else contextlib.nullcontext() as got:
            out = model(tokens[rows, start:end].masked_fill(key_mask[rows, start:end] == 0,
                                                            pad_id),
                        positions[rows, start:end], blocked, inference_context=ctx,
                        runtime_gather_output=True, positions=slice(-1, None))
            if routing is not None:
                record(got(), rows, start, end)
        ctx.enable_decode_mode()
        return out[:, -1, :true_vocab].float()

    def record(recorded: dict, rows: slice, start: int, end: int) -> None:
        """The experts each token of the pass chose, into its prompt's output columns."""
        chosen = moe.routing_of(recorded, rows.stop - rows.start, end - start,
                                config.num_layers, routing.shape[-1])
        for a, s in enumerate(range(rows.start, rows.stop)):
            cols = where[s, start:end]
            if holds[s] >= 0 and bool((cols >= 0).any()):
                routing[holds[s]][:, cols[cols >= 0]] = chosen[a][:, cols >= 0]

    # the first S prompts, left-padded into columns [0, P)
    first, first_mask = (t.to(device) for t in left_pad(prompts[:S], pad_id))
    tokens[:, P - first.shape[1]:P], key_mask[:, P - first.shape[1]:P] = first, first_mask
    positions[:, :P] = (key_mask[:, :P].cumsum(dim=1) - 1).clamp(min=0)
    where[:, :P] = torch.arange(P).masked_fill(key_mask[:, :P].cpu() == 0, -1)
    for s in range(S):
        holds[s] = s
    shared = prefill_groups(tokens[:, :P], key_mask[:, :P]) if shared_prefill else None
    copied = 0 if shared is None else S - len(shared.rows)  # prompts not prefilled: copied
    if shared is None:
        logits = forward(slice(0, S), 0, P)
    else:  # one slot per distinct prompt fed (rows 0..U-1), then copied to its twins
        fed = shared.rows
        tokens[:len(fed), :P], key_mask[:len(fed), :P], positions[:len(fed), :P] = \
            tokens[fed, :P], key_mask[fed, :P], positions[fed, :P]
        logits = forward(slice(0, len(fed)), 0, P)[shared.owner]
        spread_prefill(ctx, shared.owner, P)
        tokens[:, :P], key_mask[:, :P], positions[:, :P] = \
            tokens[shared.owner, :P], key_mask[shared.owner, :P], positions[shared.owner, :P]
    waiting = S  # the next prompt to admit
    col = P  # the next column to feed
    slot_steps = idle = 0
    while True:
        active = [s for s in range(S) if holds[s] >= 0]
        rows = torch.tensor(active, device=device)
        picked = out.sample(logits[rows], [holds[s] for s in active], params, draws, stops,
                            swaps)
        for j, s in enumerate(active):
            length[s] += 1
            if out.done(holds[s]):
                holds[s] = -1
            else:  # the sampled token is fed at ``col``
                tokens[s, col], key_mask[s, col] = picked[j], 1
                positions[s, col] = positions[s, col - 1] + 1
                where[s, col] = P + length[s] - 1
        # free slots take the next prompts: their prompt ends at ``col``, its earlier
        # tokens written now, its last fed with the others' tokens below
        twins: dict[tuple[int, ...], int] = {}  # a prompt admitted at this step -> its slot
        for s in range(S):
            if holds[s] < 0 and waiting < n:
                prompt = prompts[waiting]
                p = len(prompt)
                key_mask[s, :col + 1] = 0
                tokens[s, col + 1 - p:col + 1] = torch.tensor(prompt, device=device)
                key_mask[s, col + 1 - p:col + 1] = 1
                positions[s, col + 1 - p:col + 1] = torch.arange(p, device=device)
                where[s, :col + 1] = -1
                where[s, col + 1 - p:col + 1] = torch.arange(P - p, P)
                holds[s], length[s] = waiting, 0
                waiting += 1
                twin = twins.get(tuple(prompt)) if shared_prefill else None
                if twin is not None:  # the same columns of the same prompt: its twin's
                    copy_prefill(ctx, twin, s, col + 1 - p, col)
                    copied += 1
                elif p > 1:
                    forward(slice(s, s + 1), col + 1 - p, col)
                twins.setdefault(tuple(prompt), s)
        busy = sum(h >= 0 for h in holds)
        if not busy:
            break
        slot_steps += S
        idle += S - busy
        if interrupt is not None and interrupt():
            swaps += 1
            if recompute_kv:  # the new weights' keys and values of every column fed
                ctx = StaticInferenceContext(S, L)
                logits = forward(slice(0, S), 0, col + 1)
                col += 1
                continue
        logits = forward(slice(0, S), col, col + 1)
        col += 1
    if stats is not None:
        stats["kv_cache_bytes"] = kv_cache_bytes(ctx)
        stats["decode_slots"], stats["idle_decode_slots"] = slot_steps, idle
        stats["shared_prefills"] = copied
    return out.generation(prompts, pad_id, routing, interrupt is not None)


class Sampled:
    """What each of ``n`` prompts sampled, up to ``T`` tokens: the tokens, their log-probs,
    the weight swaps before each (partial rollouts) and whether a stop token ended it."""

    def __init__(self, n: int, T: int):
        self.T = T
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]
        self.finished = [False] * n

    def sample(self, logits: torch.Tensor, prompts: list[int], params: SamplingParams,
               draws: SeededDraws | None, stops: torch.Tensor, version: int) -> torch.Tensor:
        """The next token of each of ``prompts`` from its row of ``logits`` (draws: each
        prompt's own) -> the (rows,) tokens, recorded."""
        picked, picked_lp = sample_next(
            logits, params,
            draw=(lambda: draws.next(prompts)) if draws is not None else None)
        stopped = torch.isin(picked, stops)
        for j, i in enumerate(prompts):
            self.tokens[i].append(int(picked[j]))
            self.logprobs[i].append(float(picked_lp[j]))
            self.versions[i].append(version)
            self.finished[i] = bool(stopped[j])
        return picked

    def done(self, i: int) -> bool:
        """Whether prompt ``i`` stopped or reached ``T`` tokens."""
        return self.finished[i] or len(self.tokens[i]) == self.T

    def generation(self, prompts: list[list[int]], pad_id: int, routing: torch.Tensor | None,
                   swapped: bool) -> Generation:
        """A :class:`Generation`: left-padded prompts, right-padded responses, their
        log-probs and weight versions (``swapped``: partial rollouts), and the routing
        record's first P + T columns."""
        return _assemble(prompts, self.tokens, self.logprobs, self.versions, self.finished,
                         pad_id, routing, swapped)


def _assemble(prompts: list[list[int]], responses: list[list[int]],
              logprobs: list[list[float]], versions: list[list[int]], finished: list[bool],
              pad_id: int, routing: torch.Tensor | None, swapped: bool) -> Generation:
    n = len(prompts)
    P = max(len(p) for p in prompts)
    prompt_tokens, prompt_mask = left_pad(prompts, pad_id)
    width = max(len(r) for r in responses)
    response = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    lp = torch.zeros(n, width)
    version = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        k = len(responses[i])
        response[i, :k] = torch.tensor(responses[i])
        mask[i, :k] = 1
        lp[i, :k] = torch.tensor(logprobs[i])
        version[i, :k] = torch.tensor(versions[i])
    return Generation(prompt_tokens, prompt_mask, response, mask, lp,
                      torch.tensor(finished, dtype=torch.bool),
                      routing_BLSK=routing[:, :, :P + width] if routing is not None else None,
                      versions_BT=version if swapped else None)
