"""The KV cache of a replica's multi-turn episodes kept across their turns
(:mod:`megarlhf.speedups.turn_kv` says how and why)."""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megarlhf.inference.generate import (SamplingParams, SeededDraws, _attention_blocked,
                                        sample_next)
from megarlhf.inference.kv_cache import kv_cache_bytes
from megarlhf.speedups.turn_kv import row_rotary


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
        stopped = set(stops.tolist())
        while True:
            token, logprob = sample_next(logits[index], params,
                                         draw=(lambda: draws.next(every)) if draws else None)
            token, logprob = token.tolist(), logprob.tolist()
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
