"""Continuous batching on the paged KV cache (``rollout.kv_cache: paged``, the default
where the model allows it): at most ``slots`` prompts decode at once, a prompt that stops
gives its slot and its blocks to the next one waiting, and the pool holds
``rollout.kv_cache_tokens`` positions (:mod:`~megarlhf.inference.paged_kv`).

A slot's pass feeds one token: the prompt's last token when it was just admitted (its
earlier tokens prefilled, or shared with a twin in the pool), else the token it sampled
last. A prompt that comes back after a preemption prefills its prompt and the tokens it
sampled, all but the last, which the step feeds. The samples are those of
:func:`~megarlhf.inference.generate.generate` for the same per-prompt seeds (greedy, or
``row_seeds``), whichever slot, step or pool size a prompt gets; a row's logits can
differ in the last bits with the batch it is computed in.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable

import torch

from megarlhf import speedups
from megarlhf.inference.continuous import Sampled
from megarlhf.inference.generate import Generation, SamplingParams, SeededDraws, stop_tensor
from megarlhf.inference.paged_kv import PagedDecoder, blocks_for
from megarlhf.models import moe
from megarlhf.models.gpt import unwrap


@torch.no_grad()
def generate_paged(model, prompts: list[list[int]], params: SamplingParams, *, slots: int,
                   eos_id: int, pad_id: int, true_vocab: int, block_tokens: int = 16,
                   cache_tokens: int | None = None, row_seeds: list[int] | None = None,
                   stats: dict | None = None, interrupt: Callable[[], bool] | None = None,
                   recompute_kv: bool = True, record_routing: bool = False,
                   shared_prefill: bool | None = None) -> Generation:
    """As :func:`~megarlhf.inference.continuous.generate_continuous`, on a pool of
    ``cache_tokens`` positions (None: every slot at full length, so nothing waits for
    blocks) in blocks of ``block_tokens``. ``stats`` also gets ``kv_blocks_peak`` (the
    most blocks in use at once) and ``kv_preemptions``. ``interrupt``: new weights before
    a step; ``recompute_kv`` then computes every live slot's keys and values again (the
    slots give their blocks back and return first in line), else they stay (and a prompt
    admitted after the swap shares no blocks computed before it)."""
    if shared_prefill is None:
        shared_prefill = speedups.enabled("shared_prefill")
    if not params.greedy and row_seeds is None:
        raise ValueError("continuous batching samples with per-prompt seeds (row_seeds) or "
                         "greedily: a shared generator's draws would depend on the schedule")
    n, T = len(prompts), params.max_new_tokens
    S = min(slots, n)
    P = max(len(p) for p in prompts)
    longest = P + T - 1  # positions written: the last token sampled is never fed
    blocks = blocks_for(cache_tokens, block_tokens) if cache_tokens is not None \
        else S * blocks_for(longest, block_tokens)
    if blocks < blocks_for(longest, block_tokens):
        raise ValueError(
            f"rollout.kv_cache_tokens={cache_tokens}: one sequence needs up to {longest} "
            f"positions (the longest prompt, {P}, + rollout.max_new_tokens, {T}, - 1), "
            f"{blocks_for(longest, block_tokens)} blocks of {block_tokens}; the pool has "
            f"{blocks}")
    decoder = PagedDecoder(model, blocks=blocks, block_tokens=block_tokens, slots=S,
                           longest=longest, true_vocab=true_vocab)
    device = decoder.device
    stops = stop_tensor(params, eos_id, device)
    config = unwrap(model).config
    routing = moe.unrouted(n, config.num_layers, P + T, config.moe_router_topk or 1) \
        if record_routing else None
    draws = SeededDraws(row_seeds, true_vocab, device) if row_seeds else None
    out = Sampled(n, T)
    responses = out.tokens  # what each prompt sampled so far
    holds = [-1] * S  # the prompt each slot decodes (-1: none)
    pending = [0] * S  # the token each slot's next step feeds
    order = [0] * S  # when each slot's prompt was admitted (the last is preempted first)
    filled = [0] * S  # the weight version its prompt's keys and values were computed with
    waiting = deque(range(n))
    swaps = admitted = preempted = copied = slot_steps = idle = 0
    stepped = False  # a step ran since the last ``interrupt`` call

    def fed(slots_fed: list[int], counts: list[int]) -> list[tuple[int, int, int]]:
        """The pass's rows for :func:`_recording`: each slot's next ``counts`` positions,
        at column P - len(prompt) + position (``generate``'s layout)."""
        return [(holds[s], P - len(prompts[holds[s]]) + decoder.cached[s], c)
                for s, c in zip(slots_fed, counts)]

    def admit() -> None:
        """Free slots take the prompts waiting, in order, while the pool has their blocks:
        a fresh prompt whose twin holds a slot (or takes one now) shares the twin's blocks,
        the others prefill together."""
        nonlocal admitted, copied
        fill: list[int] = []
        twins: list[tuple[int, int, int]] = []  # (owner, slot, sequence length)
        promised = 0  # free blocks the twins will take once their owners are filled
        for s in range(S):
            if holds[s] >= 0 or not waiting:
                continue
            i = waiting[0]
            seq = prompts[i] + responses[i]
            owner = None
            if shared_prefill and not responses[i] and len(seq) > 1:
                owner = next((t for t in range(S) if holds[t] >= 0 and filled[t] == swaps
                              and prompts[holds[t]] == prompts[i]
                              and (t in fill or decoder.cached[t] >= len(seq) - 1)), None)
            whole = (len(seq) - 1) // block_tokens if owner is not None else 0
            if blocks_for(len(seq), block_tokens) - whole > len(decoder.free) - promised:
                break
            waiting.popleft()
            holds[s], pending[s], order[s], filled[s] = i, seq[-1], admitted, swaps
            admitted += 1
            if owner is not None:
                twins.append((owner, s, len(seq)))
                promised += blocks_for(len(seq), block_tokens) - whole
                copied += 1
                continue
            decoder.reserve(s, len(seq))
            if len(seq) > 1:
                fill.append(s)
        if fill:
            sequences = [(prompts[holds[s]] + responses[holds[s]])[:-1] for s in fill]
            with _recording(model, routing, fed(fill, [len(q) for q in sequences])):
                decoder.prefill(fill, sequences)
        for owner, s, length in twins:
            decoder.share(owner, s, length - 1)
            decoder.reserve(s, length)
            if routing is not None:  # the shared positions' experts are the owner's
                i, p = holds[s], length
                routing[i][:, P - p:P - 1] = routing[holds[owner]][:, P - p:P - 1]

    def grow(active: list[int]) -> list[int]:
        """Each live slot's block for the position its step writes; when the pool is out,
        the slot admitted last gives its blocks back and waits, first in line."""
        nonlocal preempted
        for s in sorted(active, key=lambda s: order[s]):
            while holds[s] >= 0 and not decoder.reserve(s, decoder.cached[s] + 1):
                last = max((t for t in range(S) if holds[t] >= 0), key=lambda t: order[t])
                waiting.appendleft(holds[last])
                holds[last] = -1
                decoder.release(last)
                preempted += 1
        return [s for s in active if holds[s] >= 0]

    while True:
        admit()
        active = [s for s in range(S) if holds[s] >= 0]
        if not active:
            assert not waiting, "a waiting prompt the empty pool cannot hold"
            break
        swapped = interrupt is not None and stepped and interrupt()  # once after a step
        stepped = False
        if swapped:
            swaps += 1
            if recompute_kv:  # the new weights' keys and values of every live slot
                for s in sorted(active, key=lambda s: order[s], reverse=True):
                    waiting.appendleft(holds[s])
                    holds[s] = -1
                    decoder.release(s)
                continue
        active = grow(active)
        slot_steps += S
        idle += S - len(active)
        with _recording(model, routing, fed(active, [1] * len(active))):
            logits = decoder.step(active, [pending[s] for s in active])
        picked = out.sample(logits, [holds[s] for s in active], params, draws, stops, swaps)
        for j, s in enumerate(active):
            if out.done(holds[s]):
                holds[s] = -1
                decoder.release(s)
            else:
                pending[s] = int(picked[j])
        stepped = True
    if stats is not None:
        stats["kv_cache_bytes"] = decoder.cache_bytes()
        stats["kv_blocks_peak"], stats["kv_preemptions"] = decoder.peak, preempted
        stats["decode_slots"], stats["idle_decode_slots"] = slot_steps, idle
        stats["shared_prefills"] = copied
    decoder.close()
    return out.generation(prompts, pad_id, routing, interrupt is not None)


@contextlib.contextmanager
def _recording(model, routing: torch.Tensor | None, rows: list[tuple[int, int, int]]):
    """Within a pass: the experts each fed token chose, into its prompt's output columns.
    ``rows``: per pass row, (prompt, the output column of its first token fed, tokens
    fed); the padding after a prefill row's tokens is not recorded."""
    if routing is None:
        yield
        return
    with moe.recording(model) as got:
        yield
        recorded = got()
    width = next(iter(recorded.values())).shape[0] // len(rows)
    chosen = moe.routing_of(recorded, len(rows), width, routing.shape[1], routing.shape[-1])
    for a, (i, column, count) in enumerate(rows):
        routing[i][:, column:column + count] = chosen[a][:, :count]
