"""A multi-turn episode's keys and values kept across its turns (``rollout.environment``).

Replaces: :meth:`megarlhf.rollout.episodes.Episodes.sample`'s one
:func:`~megarlhf.inference.generate.generate` per turn, which prefills each live
episode's whole conversation again (its prompt, every turn so far and every observation)
before sampling the next turn. With this speed-up the replica's episodes decode on one
megatron ``StaticInferenceContext`` for the whole rollout: a turn feeds only what the
cache lacks - the first turn the prompt, a later one the previous turn's stop token and
the environment's observation - and samples on.

Layout (as ``inference.continuous``): the rows share columns. Each turn's new tokens of
every row end at one column, right-aligned; the columns before them that the row does not
fill are masked out of its attention, and its position ids count its own tokens, so a row
sees exactly its conversation. megatron's rotary embedding rotates by column (its cache
keeps keys unrotated and rotates ``[:end]`` at each pass), which a row's gaps would put
out of step with its positions: :func:`row_rotary` hands it a table per row instead, each
column rotated by that row's position there. Decode steps add one column for every row
still sampling. The context grows (a copy) when a turn needs more columns than it has.
Models whose attention builds its own rotary embedding (YaRN, multi-latent attention)
re-prefill instead (:func:`applies`).

Samples are :func:`generate`'s for the same per-turn, per-episode seeds (greedy, or one
draw per token from each episode's own stream). Bitwise: no - the cached columns were
computed in other passes than one prefill of the whole conversation, which this machine's
BLAS may sum in another order (tests/test_multiturn.py: the same episodes, tokens and
masks as re-prefilling; log-probs to float rounding).

Measured: see BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megarlhf.inference.generate import (SamplingParams, SeededDraws, _attention_blocked,
                                        sample_next)
from megarlhf.inference.kv_cache import kv_cache_bytes
from megarlhf.models.gpt import unwrap


def columns(max_seq_len: int) -> int:
    """The columns a replica's cache starts with (``data.max_seq_len``: an episode's
    tokens): room for the gaps of right-aligned turns before it grows."""
    return 2 * max_seq_len


def applies(model) -> bool:
    """Whether ``model``'s positions reach attention in a way :class:`TurnCache` steers:
    learned absolute position embeddings (the position ids), or megatron's plain RoPE."""
    gpt = unwrap(model)
    return gpt.position_embedding_type in ("rope", "learned_absolute") \
        and not gpt.config.multi_latent_attention


@contextlib.contextmanager
def row_rotary(model, positions_BL: torch.Tensor):
    """megatron's rotary table of the model's passes, per row: column ``c`` of row ``b``
    rotated by ``positions_BL[b, c]`` ((L, B, 1, d) instead of (L, 1, 1, d))."""
    gpt = unwrap(model)
    if gpt.position_embedding_type != "rope":
        yield
        return
    rope = gpt.rotary_pos_emb
    original = rope.forward

    def per_row(max_seq_len: int, *args, **kwargs):
        table = original(int(positions_BL.max()) + 1, *args, **kwargs)  # (P, 1, 1, d)
        return table[:, 0, 0][positions_BL.t()].unsqueeze(2)

    rope.forward = per_row
    try:
        yield
    finally:
        del rope.forward  # the class's again


class TurnCache:
    """The KV cache of ``rows`` episodes across their turns; every TP rank of a replica
    holds one and calls it alike."""

    def __init__(self, model, rows: int, *, pad_id: int, true_vocab: int, columns: int):
        self.model, self.pad_id, self.true_vocab, self.B = model, pad_id, true_vocab, rows
        self.device = next(model.parameters()).device
        self.L = columns
        self.tokens = torch.full((rows, columns), pad_id, dtype=torch.long, device=self.device)
        self.key_mask = torch.zeros(rows, columns, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, columns, dtype=torch.long, device=self.device)
        self.fed = [0] * rows  # each row's tokens in the cache (its next position)
        self.col = 0  # the next free column
        self.ctx = StaticInferenceContext(rows, columns)

    def cache_bytes(self) -> int:
        return kv_cache_bytes(self.ctx)

    def _grow(self, columns: int) -> None:
        """At least ``columns`` columns: the context's memory and the row state copied into
        larger tensors."""
        if columns <= self.L:
            return
        wider = max(columns, 2 * self.L)

        def widen(t: torch.Tensor, dim: int, fill) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = wider
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            out.narrow(dim, 0, self.L).copy_(t)
            return out

        self.tokens = widen(self.tokens, 1, self.pad_id)
        self.key_mask, self.positions = widen(self.key_mask, 1, 0), widen(self.positions, 1, 0)
        for layer, memories in self.ctx.key_value_memory_dict.items():  # (columns, rows, ...)
            self.ctx.key_value_memory_dict[layer] = tuple(widen(m, 0, 0) for m in memories)
        self.ctx.max_sequence_length = self.L = wider

    def feed(self, new: dict[int, list[int]]) -> torch.Tensor:
        """Append each row's ``new`` tokens, right-aligned to end at one column, in one
        pass over every row; the logits (B, V) at that column."""
        width = max(len(tokens) for tokens in new.values())
        start, end = self.col, self.col + width
        self._grow(end)
        for row, tokens in new.items():
            n = len(tokens)
            self.tokens[row, end - n:end] = torch.tensor(tokens, device=self.device)
            self.key_mask[row, end - n:end] = 1
            self.positions[row, end - n:end] = torch.arange(self.fed[row], self.fed[row] + n,
                                                            device=self.device)
            self.fed[row] += n
        self.col = end
        ctx = self.ctx
        ctx.batch_size_offset, ctx.sequence_len_offset = 0, start
        blocked = _attention_blocked(self.key_mask[:, :end], width)
        inp = self.tokens[:, start:end].masked_fill(self.key_mask[:, start:end] == 0,
                                                    self.pad_id)
        with row_rotary(self.model, self.positions):
            out = self.model(inp, self.positions[:, start:end], blocked, inference_context=ctx,
                             runtime_gather_output=True, positions=slice(-1, None))
        ctx.enable_decode_mode()
        return out[:, -1, :self.true_vocab].float()

    def turn(self, conversations: dict[int, list[int]], caps: dict[int, int],
             params: SamplingParams, seeds: dict[int, int], stops: torch.Tensor,
             stats: dict) -> dict[int, tuple[list[int], list[float]]]:
        """The next turn of each row in ``caps`` (its most new tokens): what its
        conversation (``conversations``: prompt, turns and observations so far) adds to
        the cache is fed, then tokens sampled until a stop token or the cap. A row of
        ``conversations`` without a cap is fed only (the first turn feeds every row, so no
        row's attention is ever empty). Returns {row: (sampled tokens, their log-probs)};
        ``stats`` counts ``decode_slots`` / ``idle_decode_slots`` as ``generate`` does."""
        live = sorted(caps)
        new = {r: c[self.fed[r]:] for r, c in conversations.items() if len(c) > self.fed[r]}
        if any(r not in new for r in live):
            raise RuntimeError("a live episode has nothing new to feed its turn")
        logits = self.feed(new)
        index = torch.tensor(live, device=self.device)
        draws = SeededDraws([seeds[r] for r in live], self.true_vocab, self.device) \
            if not params.greedy else None
        every = list(range(len(live)))
        out: dict[int, tuple[list[int], list[float]]] = {r: ([], []) for r in live}
        sampling = set(live)
        while True:
            token, logprob = sample_next(logits[index], params,
                                         draw=(lambda: draws.next(every)) if draws else None)
            token, logprob = token.tolist(), logprob.tolist()
            stopped = set(stops.tolist())
            for i, row in enumerate(live):
                if row not in sampling:
                    continue
                out[row][0].append(token[i])
                out[row][1].append(logprob[i])
                if token[i] in stopped or len(out[row][0]) >= caps[row]:
                    sampling.discard(row)
            if not sampling:
                return out
            stats["decode_slots"] = stats.get("decode_slots", 0) + len(live)
            stats["idle_decode_slots"] = stats.get("idle_decode_slots", 0) \
                + len(live) - len(sampling)
            logits = self.feed({row: [out[row][0][-1]] for row in sorted(sampling)})
