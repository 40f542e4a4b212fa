"""A paged KV cache for decode slots (``rollout.kv_cache: paged``): one pool of fixed-size
blocks per layer, shared by every slot, so that memory follows the tokens in flight.

The columns cache of :mod:`~megarlhf.inference.continuous` gives each slot a row of
columns that only grows: a prompt admitted at decode column c is written ending at c, so
the rows are as long as the whole schedule (the longest prompt + max_new_tokens x (prompts
/ slots + 1)) and every decode step attends over all of them. Here a slot's tokens sit at
positions 0, 1, ... of blocks it takes from the pool as it grows and gives back when its
prompt stops; a freed slot's next prompt starts at position 0 again, and a decode step
attends over the longest live sequence only. What each layer keeps:

- keys and values, ``(blocks, block_tokens, groups, head)`` each, in the model's dtype
  (:func:`pool_bytes`; ``megarlhf plan`` counts the same);
- a slot's block table (host-side lists): position j of slot s is offset
  ``j % block_tokens`` of block ``owned[s][j // block_tokens]``.

A pass writes a layer's new keys and values at the positions the decoder set before it
(:class:`PagedKV`, attached to each layer's core attention as ``static_kv`` is), and a
decode step gathers each row's blocks into (B, groups, K, head) and attends under the
mask of its length. A prompt's repeated copies (a GRPO group) share the blocks its
prompt fills whole (reference counts; :mod:`megarlhf.speedups.shared_prefill`), and copy
the partly filled last one, which they go on writing.

The pool may be smaller than every slot at full length (``rollout.kv_cache_tokens``): a
prompt waits until the blocks its sequence needs are free, and when a growing slot finds
none, the slot admitted last gives its blocks back and waits again, first in line, with
the tokens it sampled (its keys and values computed again when it returns: vLLM's
preemption by recomputation). Samples use per-prompt seeds, so neither changes them.
"""

from __future__ import annotations

import torch

from megarlhf.inference.static_kv import decode_pass, rotary_table, unsupported
from megarlhf.models.gpt import unwrap
from megarlhf.models.spec import window_blocked


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-tokens // block_tokens)


def pool_bytes(*, layers: int, blocks: int, block_tokens: int, groups: int, head_dim: int,
               value_dim: int, dtype_bytes: int) -> int:
    """Bytes of the pool's keys and values over every layer (one TP rank's groups)."""
    return layers * blocks * block_tokens * groups * (head_dim + value_dim) * dtype_bytes


class PagedKV:
    """One layer's pool: ``k`` (blocks, block_tokens, groups, head), ``v`` (..., value)."""

    def __init__(self, shared: "PagedDecoder", blocks: int, block_tokens: int, groups: int,
                 head_dim: int, value_dim: int, dtype, device):
        self.shared = shared
        self.k = torch.zeros(blocks, block_tokens, groups, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(blocks, block_tokens, groups, value_dim, dtype=dtype, device=device)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key (s, B, groups, head), value (s, B, groups, value): the pass's tokens at
        (``src_col``, ``src_row``) into their positions' (``dest_block``, ``dest_offset``)."""
        sh = self.shared
        self.k[sh.dest_block, sh.dest_offset] = key[sh.src_col, sh.src_row]
        self.v[sh.dest_block, sh.dest_offset] = value[sh.src_col, sh.src_row]

    def attend(self, core, query: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """A decode step's attention: query (1, B, heads, head) over each row's blocks
        (``gather``, (B, nb)); ``blocked`` (B, 1, 1, nb * block_tokens) True past a row's
        length -> (1, B, heads * value)."""
        table = self.shared.gather
        B, nb = table.shape
        k = self.k[table].reshape(B, -1, core.groups, core.head_dim).transpose(1, 2)
        v = self.v[table].reshape(B, -1, core.groups, core.value_dim).transpose(1, 2)
        q = query.permute(1, 2, 0, 3)
        outside = window_blocked(core.window, self.shared.query_position, k.shape[2])
        if outside is not None:  # a row's keys sit at its positions 0, 1, ...
            blocked = blocked | outside
        out = core.attend_allowed(q, k, v, ~blocked)
        return out.permute(2, 0, 1, 3).reshape(1, B, core.heads * core.value_dim)


class PagedDecoder:
    """The pool, the slots' block tables and the passes that read and write them.

    ``blocks`` of ``block_tokens`` positions each; ``slots`` block tables; a sequence is at
    most ``longest`` positions. :meth:`prefill` writes slots' first positions, :meth:`step`
    feeds one token per slot; the block bookkeeping (:meth:`reserve`, :meth:`share`,
    :meth:`release`) is the caller's, before each pass."""

    def __init__(self, model, *, blocks: int, block_tokens: int, slots: int, longest: int,
                 true_vocab: int):
        reason = unsupported(model, experts=True)
        if reason:
            raise ValueError(f"a paged KV cache cannot decode this model: {reason}")
        self.model, self.gpt = model, unwrap(model)
        self.block_tokens, self.true_vocab = block_tokens, true_vocab
        self.free = list(range(blocks - 1, -1, -1))  # pop() takes the lowest
        self.refs = [0] * blocks
        self.owned: list[list[int]] = [[] for _ in range(slots)]
        self.cached = [0] * slots  # positions written per slot
        self.peak = 0  # most blocks in use at once
        self.decoding = False
        device = self.gpt.embedding.word_embeddings.weight.device
        self.device = device
        dtype = self.gpt.embedding.word_embeddings.weight.dtype
        self.cores = [layer.self_attention.core_attention for layer in self.gpt.decoder.layers]
        for core in self.cores:
            core.static_kv = PagedKV(self, blocks, block_tokens, core.groups, core.head_dim,
                                     core.value_dim, dtype, device)
        self.rope = rotary_table(self.gpt, longest)  # (longest, 1, 1, dim)
        self.dest_block = self.dest_offset = self.src_col = self.src_row = None
        self.gather = None
        self.query_position = None  # (B,) a decode step's positions (sliding windows)

    # ------------------------------------------------------------ blocks

    def cache_bytes(self) -> int:
        """Bytes of the pool's keys and values over every layer."""
        return sum(t.numel() * t.element_size() for core in self.cores
                   for t in (core.static_kv.k, core.static_kv.v))

    def needs(self, slot: int, tokens: int) -> int:
        """Blocks slot ``slot`` must still take to hold ``tokens`` positions."""
        return max(0, blocks_for(tokens, self.block_tokens) - len(self.owned[slot]))

    def reserve(self, slot: int, tokens: int) -> bool:
        """Take the blocks slot ``slot`` needs for ``tokens`` positions; False (nothing
        taken) when the pool has too few free."""
        need = self.needs(slot, tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            block = self.free.pop()
            self.refs[block] = 1
            self.owned[slot].append(block)
        self.peak = max(self.peak, len(self.refs) - len(self.free))
        return True

    def share(self, owner: int, slot: int, tokens: int) -> None:
        """Slot ``slot`` (holding no blocks) starts with ``owner``'s first ``tokens``
        positions: the blocks they fill whole are shared, the last partly filled one copied
        into a block of its own (the caller checked one is free)."""
        assert not self.owned[slot]
        whole, part = divmod(tokens, self.block_tokens)
        for block in self.owned[owner][:whole]:
            self.refs[block] += 1
            self.owned[slot].append(block)
        if part:
            self.reserve(slot, tokens)
            src, dst = self.owned[owner][whole], self.owned[slot][whole]
            for core in self.cores:
                core.static_kv.k[dst] = core.static_kv.k[src]
                core.static_kv.v[dst] = core.static_kv.v[src]
        self.cached[slot] = tokens

    def release(self, slot: int) -> None:
        """Slot ``slot``'s blocks back to the pool (a shared one once its last user goes)."""
        for block in self.owned[slot]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free.append(block)
        self.owned[slot] = []
        self.cached[slot] = 0

    def in_use(self) -> int:
        """Blocks some slot holds."""
        return len(self.refs) - len(self.free)

    # ------------------------------------------------------------ passes

    def _targets(self, slots: list[int], starts: list[int], counts: list[int]) -> None:
        """Pass row a writes positions starts[a] .. starts[a] + counts[a] - 1 of slot
        slots[a], from its columns 0 .. counts[a] - 1 (a prefill) or column 0 (a step)."""
        blocks, offsets, cols, rows = [], [], [], []
        for a, (s, start, count) in enumerate(zip(slots, starts, counts)):
            for j in range(start, start + count):
                blocks.append(self.owned[s][j // self.block_tokens])
                offsets.append(j % self.block_tokens)
                cols.append(j - start)
                rows.append(a)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        self.dest_block, self.dest_offset = as_long(blocks), as_long(offsets)
        self.src_col, self.src_row = as_long(cols), as_long(rows)

    def prefill(self, slots: list[int], sequences: list[list[int]]) -> None:
        """Write the keys and values of each slot's ``sequences`` (its first positions; the
        blocks reserved) in one right-padded causal pass: a row's tokens see only the ones
        before them, so the padding after them changes nothing."""
        C = max(len(seq) for seq in sequences)
        tokens = torch.zeros(len(slots), C, dtype=torch.long, device=self.device)
        for a, seq in enumerate(sequences):
            tokens[a, :len(seq)] = torch.tensor(seq, device=self.device)
        positions = torch.arange(C, device=self.device).expand(len(slots), C)
        blocked = torch.ones(C, C, dtype=torch.bool, device=self.device).triu(1)
        self._targets(slots, [0] * len(slots), [len(seq) for seq in sequences])
        self.decoding = False
        self.model(tokens, positions, blocked.view(1, 1, C, C).expand(len(slots), 1, C, C),
                   runtime_gather_output=True, positions=slice(-1, None))
        for s, seq in zip(slots, sequences):
            self.cached[s] = len(seq)

    def step(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed one token per slot at its next position (its block reserved) -> (B, V)
        float logits there."""
        at = [self.cached[s] for s in slots]
        self._targets(slots, at, [1] * len(slots))
        nb = max(blocks_for(c + 1, self.block_tokens) for c in at)
        table = torch.zeros(len(slots), nb, dtype=torch.long)
        for a, s in enumerate(slots):
            owned = self.owned[s][:nb]
            table[a, :len(owned)] = torch.tensor(owned)
        self.gather = table.to(self.device)
        length = torch.tensor(at, device=self.device) + 1
        K = nb * self.block_tokens
        blocked = torch.arange(K, device=self.device).view(1, K) >= length.view(-1, 1)
        position = torch.tensor(at, dtype=torch.long, device=self.device).view(-1, 1)
        self.query_position = position.view(-1)
        rope = None
        if self.rope is not None:
            rope = self.rope.index_select(0, position.view(-1)).transpose(0, 1)  # (1, B, 1, d)
        self.decoding = True
        logits = decode_pass(self.gpt, torch.tensor(tokens, device=self.device).view(-1, 1),
                             position, rope, blocked.view(len(slots), 1, 1, K), self.true_vocab)
        for s in slots:
            self.cached[s] += 1
        return logits

    def close(self) -> None:
        """Detach the pools from the layers (the model decodes as before)."""
        for core in self.cores:
            core.static_kv = None
