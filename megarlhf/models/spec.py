"""Layer-spec selection: megatron-core local layers with SDPA attention, or
TransformerEngine layers (required for fp8) where TE imports and CUDA is present.

The model code never branches on the implementation: it receives a ``ModuleSpec``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import (
    is_layer_window_attention, make_sharded_tensors_for_checkpoint)

from megarlhf import speedups
from megarlhf.config import ModelConfig
from megarlhf.models import moe
from megarlhf.parallel import context
from megarlhf.speedups import linears


class SDPACoreAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for megatron's ``DotProductAttention`` (same constructor and forward
    signature), which allocates its score buffer on CUDA. Megatron's mask convention:
    ``attention_mask`` is boolean with True where attention is *not* allowed.
    Shapes: query (sq, B, heads, hd), key/value (sk, B, groups, hd) -> (sq, B, heads*hd)
    (multi-latent attention: values of their own width ``v_channels``).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, k_channels=None, v_channels=None):
        super().__init__(config=config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.tp_group = pg_collection.tp  # megatron's sharded_state_dict reads it
        tp_size = pg_collection.tp.size()
        # context parallelism: this rank holds part of each sequence (parallel.context)
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if config.context_parallel_size > 1 else None
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp_size
        self.groups = config.num_query_groups // tp_size
        # multi-latent attention: queries and keys k_channels wide, values v_channels
        self.head_dim = k_channels or config.kv_channels
        self.value_dim = v_channels or self.head_dim
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        # sliding-window attention (model.sliding_window): the keys a query sees, itself
        # included, in this layer; None: all before it
        window = config.window_size
        self.window = window[0] + 1 if window and is_layer_window_attention(
            window, config.window_attn_skip_freq, layer_number) else None
        # attention sinks (model.attention_sinks): a learned logit per head in every
        # query's softmax, attending to nothing; megatron's name, split over TP by head
        self.softmax_offset = None
        if config.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(self.heads,
                                                                 dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: the local attention "
                             "takes 'vanilla' or 'learnable'")
        # a generation's fixed-shape KV cache while one decodes on it
        # (megarlhf.inference.static_kv); None otherwise
        self.static_kv = None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The sinks split over TP by head, as megatron's own attention saves them."""
        if self.softmax_offset is None:
            return {}
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset}, prefix, {"softmax_offset": 0},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            return self.forward_packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            sq = query.shape[0]
            out = context.attention(self.attend_allowed, query.permute(1, 2, 0, 3),
                                    key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                                    self.cp_group, attention_mask)
            return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], self.heads * self.value_dim)
        kv = self.static_kv
        if kv is not None and kv.shared.decoding:
            kv.write(key, value)
            return kv.attend(self, query, attention_mask)
        sq = query.shape[0]
        out = self.attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3),
                          value.permute(1, 2, 0, 3), attention_mask, attn_mask_type)
        if kv is not None:  # the prefill: the prompt's columns into the cache
            kv.write(key, value)
        # (B, heads, sq, hd) -> (sq, B, heads*hd)
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], self.heads * self.value_dim)

    def forward_packed(self, query, key, value, packed_seq_params) -> torch.Tensor:
        """Megatron's THD format (``data.packing``): query (t, heads, hd), key and value
        (t, groups, hd), samples back to back as ``cu_seqlens_q`` says -> (t, heads*hd).
        Causal attention within each sample, one SDPA call per sample: the work and the
        numbers of each sample alone, and no t x t mask."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed sequences in the {packed_seq_params.qkv_format!r} "
                             "format: the local attention takes 'thd'")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if self.cp_group is not None:  # the samples' bounds in the whole row
            out = context.attention_packed(self.attend_allowed, query, key, value, bounds,
                                           self.cp_group)
            return out.reshape(out.shape[0], -1)
        outs = []
        for start, stop in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[start:stop].permute(1, 0, 2).unsqueeze(0).contiguous()
                       for x in (query, key, value))
            out = self.attend(q, k, v, None, AttnMaskType.causal)  # (1, heads, n, hd)
            outs.append(out[0].permute(1, 0, 2).reshape(stop - start, -1))
        return torch.cat(outs)

    def attend_allowed(self, q, k, v, allowed) -> torch.Tensor:
        """SDPA under ``allowed``: a boolean mask (True = may attend) or None; each K/V
        group shared by its queries without copying. With sinks, each query's softmax has
        its head's sink logit as one more key, of value zero: the sink key is a channel
        the real keys leave at 0, the queries carry sink / scale there, and the sink's
        score is the sink itself (scale * sink / scale * 1)."""
        dropout = self.dropout_p if self.training else 0.0
        gqa = self.groups != self.heads
        if self.softmax_offset is not None:
            q, k, v, allowed = with_sinks(q, k, v, allowed, self.softmax_offset,
                                          self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout,
                                              scale=self.softmax_scale,
                                              enable_gqa=gqa)

    def attend(self, q, k, v, attention_mask, attn_mask_type=None) -> torch.Tensor:
        """The attention in SDPA's layout: q (B, heads, sq, hd), k and v (B, groups, sk,
        hd) -> (B, heads, sq, hd). The KV-cached decode step calls it on its buffers,
        which are laid out so."""
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, sk = q.shape[2], k.shape[2]
        causal = mask_type == AttnMaskType.causal and sq > 1
        # a window as long as the keys cuts nothing: the mask-free (flash) path stays open
        window = self.window if self.window is not None and self.window < sk else None
        if causal and attention_mask is None and sq == sk and window is None \
                and self.softmax_offset is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0,
                scale=self.softmax_scale, enable_gqa=self.groups != self.heads)
        allowed = _allowed(attention_mask, causal, sq, sk, q.device)
        if window is not None:
            band = _window(sq, sk, window, q.device)
            allowed = band if allowed is None else allowed & band
        return self.attend_allowed(q, k, v, allowed)


def with_sinks(q, k, v, allowed, sinks: torch.Tensor, scale: float):
    """(q, k, v, allowed) of attention with a sink per head (``sinks`` (heads,)) as SDPA
    without sinks computes it: a first key, seen by every query, scoring each head's sink
    and adding a zero value. q (B, heads, sq, d), k (B, groups, sk, d), v (B, groups, sk,
    dv) and ``allowed`` ((.., sq, sk) bool, or None: all) -> q and k one channel wider,
    sk + 1 keys."""
    B, heads, sq, _ = q.shape
    groups = k.shape[1]
    column = (sinks.to(q.dtype) / scale).view(1, heads, 1, 1).expand(B, heads, sq, 1)
    q = torch.cat([q, column], dim=-1)
    sink_key = torch.zeros(B, groups, 1, k.shape[-1] + 1, dtype=k.dtype, device=k.device)
    sink_key[..., -1] = 1
    k = torch.cat([sink_key, F.pad(k, (0, 1))], dim=2)
    v = torch.cat([v.new_zeros(B, groups, 1, v.shape[-1]), v], dim=2)
    if allowed is None:
        allowed = torch.ones(sq, k.shape[2] - 1, dtype=torch.bool, device=q.device)
    seen = torch.ones(*allowed.shape[:-1], 1, dtype=torch.bool, device=allowed.device)
    return q, k, v, torch.cat([seen, allowed], dim=-1)


def _allowed(attention_mask, causal: bool, sq: int, sk: int, device):
    """SDPA's boolean mask (True = may attend) from megatron's (True = blocked)."""
    if attention_mask is None:
        return _causal_block(sq, sk, device) if causal else None
    allowed = ~attention_mask
    if causal:
        allowed = _causal_block(sq, sk, device) & allowed
    # A query row with nothing allowed (a pad position) gives NaN in SDPA, and a NaN
    # value row poisons every row through 0 * NaN: let each position see itself.
    return allowed | _diagonal(sq, sk, device)


def _causal_block(sq: int, sk: int, device) -> torch.Tensor:
    """(sq, sk) bool, True where a query may see a key: the queries are the last sq of sk
    positions (sk > sq while prefilling on a cache)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def _window(sq: int, sk: int, window: int, device) -> torch.Tensor:
    """(sq, sk) bool, True where a query may see a key under a sliding window of
    ``window`` keys (itself included; transformers' ``kv_idx > q_idx - window``): the
    queries are the last sq of sk positions."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq - window + 1)


def window_blocked(window: int | None, query_column: torch.Tensor,
                   keys: int) -> torch.Tensor | None:
    """A decode step's keys out of a sliding window: (B, 1, 1, keys) bool, True at key
    columns ``window`` or more before each row's query column (``query_column``, (B,) or
    (1,)); None without a window."""
    if window is None:
        return None
    columns = torch.arange(keys, device=query_column.device).view(1, keys)
    return (columns <= query_column.view(-1, 1) - window).view(-1, 1, 1, keys)


def _diagonal(sq: int, sk: int, device) -> torch.Tensor:
    """(sq, sk) bool, True where query i meets its own key i + sk - sq."""
    rows = torch.arange(sq, device=device)
    out = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    out[rows, rows + (sk - sq)] = True
    return out


@functools.cache
def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE's import fails in many ways without a matching CUDA build
        return False
    return True


def resolve_impl(model: ModelConfig) -> str:
    """Pick ``local`` or ``transformer_engine``; reject what this machine cannot run."""
    te = transformer_engine_available()
    if model.fp8.enabled and not te:
        raise ValueError(
            "model.fp8.enabled=true needs TransformerEngine and a CUDA GPU "
            f"(CUDA available: {torch.cuda.is_available()}); install the 'fp8' extra on a "
            "GPU machine or set model.fp8.enabled=false")
    if model.transformer_impl == "transformer_engine" and not te:
        raise ValueError(
            "model.transformer_impl=transformer_engine but TransformerEngine cannot be used "
            f"here (CUDA available: {torch.cuda.is_available()}); use 'auto' or 'local'")
    recompute = model.recompute
    for module in ("layernorm", "mla_up_proj"):
        if recompute.granularity == "selective" and module in recompute.modules and not te:
            # megatron-core 0.16.1's CheckpointWithoutOutput, which recomputes these, takes
            # TransformerEngine's fp8 branch whatever its fp8 argument (``fp8 is not None``)
            raise ValueError(
                f"model.recompute.modules={recompute.modules}: {module} recomputation needs "
                "TransformerEngine in megatron-core 0.16.1 (its CheckpointWithoutOutput "
                "calls TransformerEngine's fp8 state); leave it out here, or use "
                "granularity=full")
    if model.own_layer:
        if model.fp8.enabled:
            raise ValueError("model.fp8.enabled=true needs TransformerEngine's layers; "
                             "OLMo's and Gemma's (model.norm_placement, "
                             "model.qk_layernorm_all_heads, model.norm_zero_centered, "
                             "model.local_rotary_base) are built from megatron's local ones")
        return "local"
    if model.transformer_impl == "local":
        if model.fp8.enabled:
            raise ValueError("model.fp8.enabled=true needs model.transformer_impl "
                             "'auto' or 'transformer_engine'")
        return "local"
    if model.transformer_impl == "auto" and model.params_dtype == "float32" \
            and not model.fp8.enabled:
        return "local"  # TE's attention has no float32 kernel for packed micro-batches
    return "transformer_engine" if te else "local"


def packed_attention_refusal(transformer_impl: str, dtype: torch.dtype) -> str | None:
    """Why layers of ``transformer_impl`` in ``dtype`` cannot take a packed micro-batch
    (megatron-core's THD format), or None. TransformerEngine's attention runs THD in its
    fused kernels, which take bfloat16 and float16 only; its unfused path takes no THD, and
    FlashAttention is not a dependency (seen on an H200 with TE 2.10: "No dot product
    attention backend is available")."""
    if transformer_impl != "transformer_engine" or dtype not in (torch.float32, torch.float64):
        return None
    return ("TransformerEngine's layers in float32 cannot take packed micro-batches: its "
            "attention has packed (THD) kernels in bfloat16 and float16 only. Set "
            "model.params_dtype=bfloat16, or model.transformer_impl=local (what 'auto' picks "
            "in float32), or turn packing off: ppo.max_tokens_per_micro_batch=null and "
            "rollout.forward_max_tokens_per_micro_batch=null (PPO), "
            "train.max_tokens_per_micro_batch=null (SFT, RM, DPO), no --max-tokens "
            "(megarlhf score)")


def layer_spec(model: ModelConfig) -> ModuleSpec:
    norm = "RMSNorm" if model.arch == "llama" else "LayerNorm"
    if resolve_impl(model) == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=model.qk_layernorm)
    if model.own_layer:
        from megarlhf.models.post_norm import post_norm_spec
        spec = post_norm_spec(spec, model)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if speedups.enabled("linears"):
        linears.use_in_spec(spec)
    return spec


def block_spec(model: ModelConfig, config, *, vp_stage: int | None, pp_rank: int):
    """The transformer block of a mixture-of-experts or multi-latent-attention model on
    this pipeline stage: megatron's per-layer specs (``model.moe.first_k_dense`` dense
    layers, then MoE layers whose experts are ``SequentialMLP``; MLA's attention when the
    config is megatron's ``MLATransformerConfig``), with SDPA attention in the local
    layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    te = resolve_impl(model) == "transformer_engine"
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                       normalization="RMSNorm", vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    if not te:
        for spec in block.layer_specs:
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
            if speedups.enabled("linears"):
                linears.use_in_spec(spec)
    if model.moe.capacity_factor is not None:  # moe/dropped_frac
        for spec in block.layer_specs:
            if hasattr(spec.submodules.mlp.submodules, "router"):
                spec.submodules.mlp.submodules.router = moe.drop_counting_router()
    return block


class SequenceParallelNorm:
    """megatron's local norm (``WrappedTorchNorm``: torch's ``LayerNorm`` / ``RMSNorm``)
    under sequence parallelism, which megatron-core 0.16.1 refuses for it. Each TP rank
    normalises its own part of the sequence, so a norm's gradient is a partial sum: its
    parameters are marked ``sequence_parallel``, and megatron's gradient finalisation sums
    them over the TP group (as it does TransformerEngine's norms)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm_class = {"LayerNorm": torch.nn.LayerNorm,
                      "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_class(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm


def sequence_parallel_spec(spec, config, *, vp_stage: int | None, pp_rank: int):
    """``spec`` (a layer's ``ModuleSpec`` or a block's submodules) with
    :class:`SequenceParallelNorm` for every local norm, the block's final norm included."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules, get_num_layers_to_build)

    def swap(item):
        if item is WrappedTorchNorm:
            return SequenceParallelNorm
        if isinstance(item, ModuleSpec):
            return dataclasses.replace(item, module=swap(item.module),
                                       submodules=swap(item.submodules))
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return dataclasses.replace(item, **{f.name: swap(getattr(item, f.name))
                                                for f in dataclasses.fields(item) if f.init})
        if isinstance(item, list):
            return [swap(x) for x in item]
        return item

    if isinstance(spec, ModuleSpec):  # one layer's spec: the block megatron would make
        spec = TransformerBlockSubmodules(
            layer_specs=[spec] * get_num_layers_to_build(config, vp_stage, pp_rank),
            layer_norm=WrappedTorchNorm)
    return swap(spec)


def activation(model: ModelConfig):
    if model.activation == "gelu_tanh":  # Gemma's GeGLU (gelu_pytorch_tanh)
        return functools.partial(F.gelu, approximate="tanh")
    if model.arch == "llama" and model.activation_alpha != 1.0:  # gpt-oss's experts
        return functools.partial(scaled_silu, alpha=model.activation_alpha)
    if model.arch == "llama":
        return F.silu
    # HF GPT-2's "gelu_new" is the tanh approximation.
    return functools.partial(F.gelu, approximate="tanh")


def scaled_silu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """x * sigmoid(alpha * x): silu with a sigmoid gain (gpt-oss's 1.702)."""
    return x * torch.sigmoid(x * alpha)
