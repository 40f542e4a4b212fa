"""A decode step whose shapes never change: the KV cache written at a device-side column,
so that CUDA can capture the step once and replay it (``speedups.decode_graphs``).

megatron-core's ``StaticInferenceContext`` slices its cache to the columns filled so far
at every step - host-side integers, keys and values that grow by one column a step - and
its own CUDA-graph path needs flash decoding (the ``flash_attn`` package). Here each
layer's core attention (:class:`~megarlhf.models.spec.SDPACoreAttention`, the local
layers') keeps its rotated keys and its values in fixed (B, groups, L, head) buffers:

- the prefill is the model's plain forward (no inference context: the same numbers as
  megatron's prefill), and each layer's attention also writes the P prompt columns;
- a decode step feeds one column through megatron's embedding, transformer block and
  head, with the rotary embedding of column ``col`` (a device tensor) for the query and
  the key; each attention writes its key and value at ``col`` and attends over all L
  columns, the ones not written yet (and padding) blocked by the generation's key mask.

Everything a step reads is a buffer that lives as long as the decoder: the fed token and
its position id, ``col``, the key mask (the generation's own, updated in place) - so the
step can be captured as a CUDA graph. Not for mixture-of-experts layers (their token
dispatch has data-dependent shapes), multi-latent attention (an attention module of its
own), TransformerEngine layers (their core attention is TE's) or pipeline stages:
:func:`unsupported` names the reason, and ``generate`` then uses megatron's context.
"""

from __future__ import annotations

import torch

from megarlhf.models.gpt import unwrap
from megarlhf.models.spec import window_blocked


def unsupported(model, experts: bool = False) -> str | None:
    """Why the model cannot decode on a static cache, or None when it can. ``experts``:
    mixture-of-experts layers are fine (eager steps, never captured: the paged cache)."""
    from megarlhf.models.spec import SDPACoreAttention

    gpt = unwrap(model)
    config = gpt.config
    if config.num_moe_experts and not experts:
        return "mixture-of-experts layers (data-dependent token dispatch)"
    if config.multi_latent_attention:
        return "multi-latent attention"
    if gpt.position_embedding_type not in ("rope", "yarn", "learned_absolute", "none"):
        return f"the {gpt.position_embedding_type!r} position embedding"
    if not (gpt.pre_process and gpt.post_process):
        return "a pipeline stage (the inference model has one)"
    if getattr(gpt, "mtp_process", False):
        return "multi-token prediction layers"
    cores = [layer.self_attention.core_attention for layer in gpt.decoder.layers]
    if not all(isinstance(c, SDPACoreAttention) for c in cores):
        return "attention that is not the local layers' (TransformerEngine's)"
    return None


class StaticKV:
    """The keys and values of one layer's attention, (B, groups, L, head) each, and the
    decode state every layer shares: ``col`` ((1,) long, the column a decode step writes)
    and ``decoding`` (False while the prefill writes the first columns)."""

    def __init__(self, shared: "StaticDecoder", batch: int, length: int, groups: int,
                 head_dim: int, value_dim: int, dtype, device):
        self.shared = shared
        self.k = torch.zeros(batch, groups, length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, groups, length, value_dim, dtype=dtype, device=device)

    def write(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key (s, B, groups, head), value (s, B, groups, value): the prefill's first s
        columns, or a decode step's column ``col``."""
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        if self.shared.decoding:
            self.k.index_copy_(2, self.shared.col, k)
            self.v.index_copy_(2, self.shared.col, v)
        else:  # (a shared prefill feeds the first rows: speedups.shared_prefill)
            self.k[:k.shape[0], :, :k.shape[2]] = k
            self.v[:v.shape[0], :, :v.shape[2]] = v

    def attend(self, core, query: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """A decode step's attention: query (1, B, heads, head) over every cached column,
        ``blocked`` (B, 1, 1, L) True where a key may not be seen -> (1, B, heads*value)."""
        q = query.permute(1, 2, 0, 3)
        outside = window_blocked(core.window, self.shared.col, self.k.shape[2])
        if outside is not None:  # the query's column is col in every row
            blocked = blocked | outside
        out = core.attend_allowed(q, self.k, self.v, ~blocked)
        return out.permute(2, 0, 1, 3).reshape(1, out.shape[0], core.heads * core.value_dim)


class StaticDecoder:
    """Prefill and decode steps of one generation on fixed buffers (see the module's
    docstring). ``key_mask`` is the generation's (B, L) mask of the columns a query may
    see: the decoder reads it in place at every step."""

    def __init__(self, model, key_mask: torch.Tensor, true_vocab: int):
        reason = unsupported(model)
        if reason:
            raise ValueError(f"a static KV cache cannot decode this model: {reason}")
        self.model, self.gpt = model, unwrap(model)
        self.key_mask, self.true_vocab = key_mask, true_vocab
        B, L = key_mask.shape
        device = key_mask.device
        self.decoding = False
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.token = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.cores = [layer.self_attention.core_attention for layer in self.gpt.decoder.layers]
        dtype = self.gpt.embedding.word_embeddings.weight.dtype
        for core in self.cores:
            core.static_kv = StaticKV(self, B, L, core.groups, core.head_dim, core.value_dim,
                                      dtype, device)
        self.rope = rotary_table(self.gpt, L)  # (L, 1, 1, rotary dim)

    def cache_bytes(self) -> int:
        """Bytes of the keys and values of every layer."""
        return sum(t.numel() * t.element_size() for core in self.cores
                   for t in (core.static_kv.k, core.static_kv.v))

    def close(self) -> None:
        """Detach the buffers from the layers (the model decodes as before)."""
        for core in self.cores:
            core.static_kv = None

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor,
                blocked: torch.Tensor) -> torch.Tensor:
        """The model's forward on the (B, P) prompt columns, writing the cache's first P
        columns -> (B, V) float logits at the last column."""
        self.decoding = False
        out = self.model(tokens, positions, blocked, runtime_gather_output=True,
                         positions=slice(-1, None))
        return out[:, -1, :self.true_vocab].float()

    @torch.no_grad()
    def spread(self, owner: torch.Tensor, columns: int) -> None:
        """After a prefill of one row per distinct prompt (rows ``0..U-1``): every row's
        first ``columns`` keys and values are its group's, ``owner[b]``
        (:mod:`megarlhf.speedups.shared_prefill`)."""
        for core in self.cores:
            for cache in (core.static_kv.k, core.static_kv.v):
                cache[:, :, :columns] = cache[owner, :, :columns]

    def step(self, token: torch.Tensor, position: torch.Tensor, col: int) -> torch.Tensor:
        """Feed (B,) tokens with their (B,) position ids at column ``col`` -> (B, V) float
        logits there. The inputs are copied into the step's buffers, then :meth:`run`."""
        self.token.copy_(token.view(-1, 1))
        self.position.copy_(position.view(-1, 1))
        self.col.fill_(col)
        self.decoding = True
        return self.run()

    def run(self) -> torch.Tensor:
        """One decode step on the buffers alone (what a CUDA graph captures)."""
        rope = None
        if self.rope is not None:
            rope = self.rope.index_select(0, self.col)
        B, L = self.key_mask.shape
        blocked = (self.key_mask == 0).view(B, 1, 1, L)
        return decode_pass(self.gpt, self.token, self.position, rope, blocked, self.true_vocab)


def rotary_table(gpt, length: int) -> torch.Tensor | None:
    """The rotary angles of positions 0..length-1, (length, 1, 1, rotary dim), as the
    model's forward computes them (YaRN's blended frequencies; its attention scales by the
    concentration factor itself); None without a rotary embedding."""
    if gpt.position_embedding_type == "rope":
        return gpt.rotary_pos_emb(length)
    if gpt.position_embedding_type == "yarn":
        return gpt.rotary_pos_emb(length)[0]  # (angles, concentration factor)
    return None


def decode_pass(gpt, token: torch.Tensor, position: torch.Tensor, rope: torch.Tensor | None,
                blocked: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """One column through megatron's embedding, transformer block and head: ``token`` and
    ``position`` (B, 1), ``rope`` the rotary angles of the column ((1, 1, 1, dim) shared, or
    (1, B, 1, dim) a row each; None without rotary), ``blocked`` the (B, 1, 1, K) keys a
    row may not see -> (B, V) float logits. The layers' core attention reads and writes the
    cache attached to it (``core.static_kv``)."""
    hidden = gpt.embedding(input_ids=token, position_ids=position)  # (1, B, H)
    rope = None if rope is None else (rope, rope)
    hidden = gpt.decoder(hidden_states=hidden, attention_mask=blocked, rotary_pos_emb=rope)
    weight = gpt.shared_embedding_or_output_weight() \
        if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
    return logits[0, :, :true_vocab].float()
