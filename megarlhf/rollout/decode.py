"""A KV-cached forward of a megatron ``GPTModel`` for sampling, lighter than megatron's.

megatron's ``StaticInferenceContext`` path runs every layer's full training-time forward
per new token: the inference-context bookkeeping in ``Attention.forward``, the
offload/recompute/CUDA-graph branches of ``TransformerLayer``, a viewless-tensor copy per
layer. At a decode step's few rows that Python is most of the time on a CPU (about a
fifth of ``generate`` at the small benchmark model, batch 16). :class:`KVCache` runs the
same modules - the embedding, each layer's norms, its linears, RoPE, the final norm and the
output layer, so tensor parallelism and every supported architecture's weights behave as in
training - around one preallocated key/value buffer per layer, read by the layer's own SDPA
core attention. It calls their ``forward`` directly (no module hooks run on this path) and
does two things itself, op for op as megatron does them: the split of the fused QKV
projection into query, key and value (:func:`_qkv`, megatron's
``get_query_key_value_tensors`` without its branches, with RoPE) and the dense MLP's
activation (:func:`_mlp`). At batch 1 of the small benchmark model their Python was about
a tenth of ``generate``; the results equal those of the modules' own forwards, bitwise but
for the sign of a zero (tested).

Only the layer shapes megarlhf builds with its local spec qualify (:func:`supported`):
self-attention with :class:`~megarlhf.models.spec.SDPACoreAttention`, a dense MLP,
pre-norm residuals, RoPE or learned absolute positions. Anything else - TransformerEngine
layers, MoE, output gates - keeps megatron's context (``generate(kv_cache="megatron")``
forces it; the two are compared in tests/test_rollout.py).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP

from megarlhf.models import rope
from megarlhf.models.gpt import unwrap
from megarlhf.models.spec import SDPACoreAttention

_LAYER_CHILDREN = {"input_layernorm", "self_attention", "pre_cross_attn_layernorm",
                   "cross_attention", "cross_attn_bda", "pre_mlp_layernorm", "mlp"}
_ATTENTION_CHILDREN = {"core_attention", "linear_proj", "linear_qkv", "q_layernorm",
                       "k_layernorm"}


def supported(model) -> bool:
    """True when :class:`KVCache` computes what megatron's forward computes for ``model``."""
    gpt = unwrap(model)
    if not (getattr(gpt, "pre_process", False) and getattr(gpt, "post_process", False)):
        return False
    if getattr(gpt, "position_embedding_type", None) not in ("rope", "learned_absolute"):
        return False
    if getattr(gpt, "mtp_process", False) or gpt.decoder.final_layernorm is None:
        return False
    config = gpt.config
    if config.apply_residual_connection_post_layernorm or config.no_rope_freq \
            or getattr(config, "attention_output_gate", False) or config.fp32_residual_connection:
        return False
    for layer in gpt.decoder.layers:
        if {name for name, _ in layer.named_children()} != _LAYER_CHILDREN:
            return False
        if not (isinstance(layer.cross_attention, IdentityOp)
                and isinstance(layer.cross_attn_bda, IdentityFuncOp)
                and isinstance(layer.mlp, MLP)):
            return False
        attention = layer.self_attention
        if getattr(attention, "attention_type", None) != "self" \
                or {name for name, _ in attention.named_children()} != _ATTENTION_CHILDREN \
                or not isinstance(attention.core_attention, SDPACoreAttention):
            return False
    return True


class KVCache:
    """Key/value buffers for ``batch`` rows of up to ``max_len`` columns and the forward
    that fills and reads them. ``forward(tokens, positions, blocked, start)`` feeds columns
    ``start .. start + n - 1`` (``tokens`` and ``positions`` (B, n), ``blocked`` (B, 1, n,
    start + n) True where a query may not look, megatron's convention) and returns the
    logits (B, V/tp gathered) at the last of them."""

    def __init__(self, model, batch: int, max_len: int):
        self.gpt = unwrap(model)
        self.layers = list(self.gpt.decoder.layers)
        first = self.layers[0].self_attention
        groups = first.num_query_groups_per_partition
        head_dim = self.head_dim = first.hidden_size_per_attention_head
        weight = next(self.gpt.parameters())
        shape = (batch, groups, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=weight.dtype, device=weight.device)
                     for _ in self.layers]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.freqs = self.gpt.rotary_pos_emb(max_len) \
            if self.gpt.position_embedding_type == "rope" else None  # (L, 1, 1, d)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor,
                start: int) -> torch.Tensor:
        n = tokens.shape[1]
        end = start + n
        hidden = self.gpt.embedding(input_ids=tokens, position_ids=positions)  # (n, B, H)
        # megatron's RoPE counts columns (left padding shifts every row alike; only
        # differences of positions reach the attention scores)
        freqs = self.freqs[start:end] if self.freqs is not None else None
        # one (cos, sin) for every layer's query and key (else megatron's RoPE per call)
        tables = rope.cos_sin(freqs, self.gpt.config, self.head_dim, self.keys[0].dtype) \
            if freqs is not None else None
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            attention = layer.self_attention
            # (n, B, heads or groups, d), the query and key rotated by ``tables``
            query, key, value = _qkv(attention, layer.input_layernorm.forward(hidden), tables)
            if tables is None and freqs is not None:
                cp = attention.pg_collection.cp
                query = apply_rotary_pos_emb(query, freqs, config=attention.config, cp_group=cp)
                key = apply_rotary_pos_emb(key, freqs, config=attention.config, cp_group=cp)
            keys[:, :, start:end] = key.permute(1, 2, 0, 3)
            values[:, :, start:end] = value.permute(1, 2, 0, 3)
            # the layer's own SDPA core attention on the cached columns, in SDPA's layout
            # (the buffers' own): (B, heads, n, d) -> (n, B, heads * d)
            out = attention.core_attention.attend(query.permute(1, 2, 0, 3),
                                                  keys[:, :, :end], values[:, :, :end], blocked)
            out = out.permute(2, 0, 1, 3).reshape(n, out.shape[0], -1)
            hidden = _residual(hidden, attention.linear_proj.forward(out))
            hidden = _residual(hidden, _mlp(layer.mlp, layer.pre_mlp_layernorm.forward(hidden)))
        hidden = self.gpt.decoder.final_layernorm(hidden[-1:])
        weight = self.gpt.shared_embedding_or_output_weight() \
            if self.gpt.share_embeddings_and_output_weights else None
        logits, _ = self.gpt.output_layer(hidden, weight=weight, runtime_gather_output=True)
        return logits[0]


def _qkv(attention, hidden: torch.Tensor, tables=None):
    """megatron's ``get_query_key_value_tensors(hidden)``, the query and the key rotated by
    RoPE's ``tables`` (:func:`rope.cos_sin`) when given: (n, B, heads, d) query, (n, B,
    groups, d) key and value. For the layouts it handles without communication or extra
    heads, from the fused projection, whose columns interleave each group's queries, key
    and value: each group's query heads and key are rotated together, in one
    :func:`rope.rotate` of a view (elementwise, so bitwise what rotating each gives), and
    the query heads are gathered into one dimension after it (the one copy). Anything else
    (query/key norms, output gates, fewer groups than TP ranks) goes to megatron's
    method."""
    config = attention.config
    if not _no_op(attention.q_layernorm) or not _no_op(attention.k_layernorm) \
            or getattr(config, "attention_output_gate", False) or config.test_mode \
            or config.num_query_groups < attention.world_size:
        query, key, value = attention.get_query_key_value_tensors(hidden, None)
        if tables is not None:
            query, key = rope.rotate(query, *tables), rope.rotate(key, *tables)
        return query, key, value
    mixed, _ = attention.linear_qkv.forward(hidden)
    groups = attention.num_query_groups_per_partition
    d = attention.hidden_size_per_attention_head
    per_group = attention.num_attention_heads_per_partition // groups
    mixed = mixed.view(*mixed.shape[:-1], groups, per_group + 2, d)
    query_key = mixed[..., :per_group + 1, :]
    if tables is not None:  # (n, 1, 1, d) -> (n, 1, 1, 1, d): over groups and heads
        query_key = rope.rotate(query_key, *(t.unsqueeze(-2) for t in tables))
    query = query_key[..., :per_group, :]
    return (query.reshape(query.shape[0], query.shape[1], -1, d), query_key[..., per_group, :],
            mixed[..., per_group + 1, :])


def _no_op(module) -> bool:
    return module is None or isinstance(module, IdentityOp)


def _mlp(mlp: MLP, hidden: torch.Tensor):
    """megatron's ``MLP.forward`` on its unfused path (no bias-activation fusion, no
    TransformerEngine activation, no per-token scale): fc1, its bias, the activation (gated:
    ``act(first half) * (second half + glu_linear_offset)``, clamped when configured), fc2.
    Returns (output, fc2's bias) as megatron's does; the fused paths go to its method."""
    config = mlp.config
    if config.use_te_activation_func or config.bias_activation_fusion or type(mlp) is not MLP:
        return mlp(hidden)
    out, bias = mlp.linear_fc1.forward(hidden)
    if bias is not None:
        out = out + bias
    if config.gated_linear_unit:
        x_glu, x_linear = torch.chunk(out, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        if config.glu_linear_offset:  # megatron adds it when 0 too: equal values
            x_linear = x_linear + config.glu_linear_offset
        out = config.activation_func(x_glu) * x_linear
    else:
        out = mlp.activation_func(out)
    return mlp.linear_fc2.forward(out)


def _residual(residual: torch.Tensor, out_and_bias) -> torch.Tensor:
    """megatron's bias-dropout-add without dropout (inference): residual + (out + bias)."""
    out, bias = out_and_bias
    return residual + (out if bias is None else out + bias)
