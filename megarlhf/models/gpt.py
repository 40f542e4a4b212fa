"""GPT-family models on megatron-core ``GPTModel``: Llama-style and GPT-2-style trunks,
with the LM head (policy, reference) or a scalar head (critic, reward model).

Nothing here knows how the model is split: the layout arrives as a
``ProcessGroupCollection`` and the pipeline stage flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megarlhf import speedups
from megarlhf.config import Layout, ModelConfig, RopeScalingConfig
from megarlhf.models import lora, moe
from megarlhf.models.spec import (activation, block_spec, layer_spec, resolve_impl,
                                  sequence_parallel_spec)
from megarlhf.speedups import linears, positions as cuts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(model: ModelConfig, layout: Layout) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` for ``model`` at ``layout`` (with YaRN's settings
    under the names megatron's GPTModel and attention read, see :func:`_yarn`)."""
    dtype = _DTYPES[model.params_dtype]
    impl = resolve_impl(model)
    fp8 = {}
    if model.fp8.enabled:
        fp8 = dict(
            fp8=model.fp8.format, fp8_recipe=model.fp8.recipe, fp8_margin=model.fp8.margin,
            fp8_amax_history_len=model.fp8.amax_history_len,
            fp8_amax_compute_algo=model.fp8.amax_compute_algo,
            first_last_layers_bf16=bool(model.fp8.num_layers_at_start_in_bf16
                                        or model.fp8.num_layers_at_end_in_bf16),
            num_layers_at_start_in_bf16=model.fp8.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=model.fp8.num_layers_at_end_in_bf16,
        )
    config_class, attention = TransformerConfig, {}
    if model.mla.enabled:
        config_class, attention = MLATransformerConfig, mla_fields(model)
    config = config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        ffn_hidden_size=model.ffn_size,
        **({} if model.mla.enabled else dict(kv_channels=model.head_size,
                                             qk_layernorm=model.qk_layernorm)),
        normalization="RMSNorm" if model.arch == "llama" else "LayerNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.arch == "llama",
        activation_func=activation(model),
        add_bias_linear=model.arch == "gpt2" or model.linear_bias,
        glu_linear_offset=model.glu_linear_offset,
        activation_func_clamp_value=model.glu_clamp,
        softmax_type="learnable" if model.attention_sinks else "vanilla",
        add_qkv_bias=model.qkv_bias,
        no_rope_freq=[int(i in model.no_rope_layers) for i in range(model.num_layers)]
        if model.no_rope_layers else None,
        **window_fields(model),
        softmax_scale=model.softmax_scale,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only or need apex/TE; the unfused paths are exact.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=False,
        # Batched isend/irecv mis-pairs messages over gloo in the interleaved schedule
        # (training losses drift; measured); NCCL batches correctly and faster.
        batch_p2p_comm=_backend_is_nccl(),
        transformer_impl="transformer_engine" if impl == "transformer_engine" else "local",
        **recompute_fields(model),
        **fp8,
        **moe.transformer_fields(model, layout),
        **attention,
    )
    if model.rope_scaling.type == "yarn" and not model.mla.enabled:
        _yarn(config, model.rope_scaling)
    return config


def window_fields(model: ModelConfig) -> dict:
    """``TransformerConfig``'s sliding-window attention for ``model.sliding_window``: a
    token sees the sliding_window - 1 before it (window_size's left edge), in the layers
    ``window_attn_skip_freq`` marks 1 (all but ``model.full_attention_layers``)."""
    if model.sliding_window is None:
        return {}
    return dict(window_size=(model.sliding_window - 1, 0),
                window_attn_skip_freq=[int(i not in model.full_attention_layers)
                                       for i in range(model.num_layers)])


def recompute_fields(model: ModelConfig) -> dict:
    """``TransformerConfig``'s activation recomputation for ``model.recompute``."""
    recompute = model.recompute
    if recompute.granularity == "full":
        return dict(recompute_granularity="full", recompute_method=recompute.method,
                    recompute_num_layers=recompute.num_layers)
    if recompute.granularity == "selective":
        return dict(recompute_granularity="selective",
                    recompute_modules=list(recompute.modules))
    return {}


def mla_fields(model: ModelConfig) -> dict:
    """``MLATransformerConfig``'s own fields for ``model.mla`` (DeepSeek-V2/V3): the
    latent and head widths, and the rotary embedding its attention builds for itself
    (plain RoPE, or YaRN with DeepSeek's mscale). Its query and key latents are always
    RMS-normalised (megatron's ``qk_layernorm`` there)."""
    mla, scaling = model.mla, model.rope_scaling
    yarn = scaling.type == "yarn"
    return dict(
        q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim, kv_channels=mla.v_head_dim, qk_layernorm=True,
        rope_type="yarn" if yarn else "rope", rotary_base=model.rotary_base,
        rotary_percent=1.0, rotary_interleaved=False,
        rotary_scaling_factor=scaling.factor if yarn else 1.0,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
        beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow,
        mscale=(scaling.mscale or 1.0) if yarn else 1.0,
        mscale_all_dim=(scaling.mscale_all_dim or 0.0) if yarn else 0.0)


def _yarn(config: TransformerConfig, scaling: RopeScalingConfig) -> None:
    """YaRN for a dense model: megatron-core's ``GPTModel(position_embedding_type='yarn')``
    builds its ``YarnRotaryEmbedding`` from ``config.yarn_*`` and its attention scales the
    rotated queries and keys by the concentration factor read from the same fields - fields
    only its multi-latent-attention config declares, so they are set on this config here.
    mscale and mscale_all_dim are passed when both are set (transformers' rule; otherwise
    the factor 0.1 ln(factor) + 1)."""
    both = bool(scaling.mscale) and bool(scaling.mscale_all_dim)
    config.yarn_rotary_scaling_factor = scaling.factor
    config.yarn_original_max_position_embeddings = scaling.original_max_position_embeddings
    config.yarn_beta_fast = scaling.beta_fast
    config.yarn_beta_slow = scaling.beta_slow
    config.yarn_mscale = scaling.mscale if both else None
    config.yarn_mscale_all_dim = scaling.mscale_all_dim if both else None
    config.yarn_correction_range_round_to_int = scaling.truncate  # transformers' truncate


def _backend_is_nccl() -> bool:
    import torch.distributed as dist
    if dist.is_initialized():
        return "nccl" in str(dist.get_backend())
    return torch.cuda.is_available()


class ScalarHead(MegatronModule):
    """Scalar output for critic and reward model, in place of ``GPTModel.output_layer``.

    Replicated on every TP rank (its input is the full hidden state after the final
    norm), so no TP communication is needed. Mimics ``ColumnParallelLinear``'s call
    signature: ``(hidden (S, B, H), weight=None, runtime_gather_output=None)`` ->
    ``((S, B, 1), None)``.
    """

    def __init__(self, config: TransformerConfig, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group  # megatron's sharded_state_dict reads it
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size,
                                                     dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = False
            p.sequence_parallel = False
        self.sequence_parallel = False

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.config.sequence_parallel:
            # (S/tp, B, H) -> (S, B, H). Every TP rank then computes the whole head and the
            # same loss, so the backward takes its own part of the gradient (no sum).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class DeferredHead:
    """The LM head (megatron's ``ColumnParallelLinear`` or the speed-up's class) that, while
    ``defer`` is set, hands its input over instead of the logits: the hidden states whole
    on every TP rank (gathered along the sequence under sequence parallelism), whose
    gradient is summed over TP on the way back - what the column-parallel linear itself does
    with its input. ``weight`` keeps the weight the forward would have used (a tied model's
    embedding). :func:`megarlhf.models.logprobs.head_logprobs` then takes the log-probs a
    chunk of positions at a time, so the positions x vocabulary logits never exist."""

    defer = False
    weight_used = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if not self.defer:
            return super().forward(input_, weight=weight,
                                   runtime_gather_output=runtime_gather_output)
        # a plain attribute (nn.Module would register a Parameter as this module's own)
        object.__setattr__(self, "weight_used", self.weight if weight is None else weight)
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=self.tp_group)
        elif self.tp_group.size() > 1:
            hidden = _SumGradOverTP.apply(input_, self.tp_group)
        else:
            hidden = input_
        return hidden, None


class _SumGradOverTP(torch.autograd.Function):
    """The identity, whose gradient is summed over the TP group: megatron's
    ``copy_to_tensor_model_parallel_region``, but for a gradient that arrives
    non-contiguous (the head's input sliced to the positions a loss reads) - megatron-core
    0.16.1's all-reduce there reduces a contiguous copy and returns the gradient unreduced."""

    @staticmethod
    def forward(ctx, input_, group):
        ctx.group = group
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


@functools.cache
def _deferred_head_class(base: type) -> type:
    return type(f"Deferred{base.__name__}", (DeferredHead, base), {})


class RoleModel(GPTModel):
    """megatron's ``GPTModel`` as a role uses it: the LM head (``kind="lm"``: policy,
    reference) or :class:`ScalarHead` (``"value"``: critic, reward model), outputs at
    chosen sequence positions only, and the tied embedding's checkpoint mapping on the
    chunk's own groups. ``true_vocab`` is the tokenizer's vocabulary (rows above it pad
    the table for TP).

    ``forward(input_ids, position_ids, attention_mask, ..., positions=None)``: with
    ``positions`` (a slice of the sequence, or an index tensor: a packed micro-batch's kept
    positions) the last stage returns (B, len, V/tp) logits
    or (B, len, 1) values at those positions only; earlier stages ignore it. Plainly the
    whole sequence is computed and sliced; ``speedups.positions`` cuts it before the
    last layer's MLP or the head instead."""

    def __init__(self, *, kind: str, true_vocab: int, **gpt_kwargs):
        super().__init__(**gpt_kwargs)
        self.kind, self.true_vocab = kind, true_vocab
        if kind == "value" and self.post_process:
            self.output_layer = ScalarHead(self.config, self.pg_collection.tp)
        elif self.post_process and speedups.enabled("linears"):
            # megatron's GPTModel builds its head itself, outside the layer spec
            self.output_layer.__class__ = linears.head_class(type(self.output_layer))
        if kind == "lm" and self.post_process:
            self.output_layer.__class__ = _deferred_head_class(type(self.output_layer))
        self.cuts_early = self.post_process and speedups.enabled("positions") \
            and cuts.head_cut_allowed(self.config)
        self._head_positions = None  # while a forward cuts at the head

    def forward(self, input_ids, position_ids, attention_mask, *args, positions=None,
                **kwargs):
        if positions is None or not self.post_process:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if not self.cuts_early:
            out = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
            return out[:, positions]
        last = self.decoder.layers[-1] if len(self.decoder.layers) else None
        if isinstance(last, cuts.CutLayer):
            last.positions = positions
        else:
            self._head_positions = positions
        try:
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            if isinstance(last, cuts.CutLayer):
                last.positions = None
            self._head_positions = None

    @contextlib.contextmanager
    def hidden_out(self):
        """Forward passes whose last stage returns the LM head's input (B, S, H) in place of
        the logits (:class:`DeferredHead`); :meth:`head_weight` is then the weight shard to
        take the log-probs with (``models.logprobs.head_logprobs``). Nothing changes on
        earlier stages or in a value model."""
        head = self.output_layer if self.post_process and self.kind == "lm" else None
        if head is None:
            yield
            return
        head.defer = True
        try:
            yield
        finally:
            head.defer = False

    def head_weight(self):
        """The LM head's weight shard of the last deferred forward (:meth:`hidden_out`)."""
        return self.output_layer.weight_used

    def _postprocess(self, hidden_states, **kwargs):
        if self._head_positions is not None:
            hidden_states = hidden_states[self._head_positions]  # (S, B, H): a view
        return super()._postprocess(hidden_states, **kwargs)

    def tie_embeddings_and_output_weights_state_dict(
            self, sharded_state_dict, output_layer_weight_key: str,
            first_stage_word_emb_key: str, metadata: dict) -> None:
        """megatron-core 0.16.1's version reads the data-parallel rank from the global
        ``parallel_state`` on the last stage of a tied model; the same logic with the
        chunk's own group (``metadata['dp_cp_group']``)."""
        from megatron.core.transformer.utils import make_tp_sharded_tensor_for_checkpoint

        if not self.post_process or self.pre_process or getattr(self, "mtp_process", False):
            return super().tie_embeddings_and_output_weights_state_dict(
                sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key,
                metadata)
        del sharded_state_dict[output_layer_weight_key]
        dp_cp = metadata["dp_cp_group"]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(), key=first_stage_word_emb_key,
            replica_id=(1, 0, dp_cp.rank()),  # a copy of the first stage's embedding
            allow_shape_mismatch=True, tp_group=self.tp_group, dp_cp_group=dp_cp)


def unwrap(model):
    """The ``GPTModel`` inside megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@torch.no_grad()
def fold_head_affine(chunks: list, gain: float, bias: float) -> None:
    """Make a value model output ``gain * v + bias``: scale the scalar head's weight and
    bias (on the chunk that holds the head; others have none)."""
    for chunk in chunks:
        head = getattr(unwrap(chunk), "output_layer", None)
        if isinstance(head, ScalarHead):
            head.weight.mul_(gain)
            head.bias.mul_(gain).add_(bias)


def build_model(model_cfg: ModelConfig, *, kind: str, padded_vocab: int, layout: Layout,
                pg_collection, pre_process: bool, post_process: bool,
                vp_stage: int | None = None) -> RoleModel:
    """One model chunk at ``layout`` (its groups in ``pg_collection``). ``kind`` is ``"lm"``
    (policy, reference) or ``"value"`` (critic, reward model). ``padded_vocab`` is the
    embedding table's row count (the vocabulary padded for TP, see
    :func:`~megarlhf.config.padded_vocab_size`). Weights are random; call
    :func:`init_weights` for the layout-independent seeded initialisation."""
    if kind not in ("lm", "value"):
        raise ValueError(f"kind must be 'lm' or 'value', got {kind!r}")
    if model_cfg.vocab_size is None:
        raise ValueError("model.vocab_size is unset: set it or configure a tokenizer")
    if (layout.cp > 1 or model_cfg.lora.enabled) and model_cfg.transformer_impl == "auto":
        # context parallelism runs megarlhf's own attention (models.spec.SDPACoreAttention,
        # parallel.context), and LoRA's adapters read the input of linear_qkv and
        # linear_fc1, which TransformerEngine's layers normalise inside the linear; its
        # layers are refused with either (config.rules, config.model)
        model_cfg = dataclasses.replace(model_cfg, transformer_impl="local")
    tcfg = transformer_config(model_cfg, layout)
    if model_cfg.moe.enabled or model_cfg.mla.enabled:
        moe.prepare_megatron()
        spec = block_spec(model_cfg, tcfg, vp_stage=vp_stage, pp_rank=pg_collection.pp.rank())
    else:
        spec = layer_spec(model_cfg)
        if model_cfg.norm_zero_centered:  # the final norm Gemma's too
            from megatron.core.transformer.transformer_block import (
                TransformerBlockSubmodules, get_num_layers_to_build)
            from megarlhf.models.post_norm import ZeroCenteredRMSNorm
            spec = TransformerBlockSubmodules(
                layer_specs=[spec] * get_num_layers_to_build(tcfg, vp_stage,
                                                             pg_collection.pp.rank()),
                layer_norm=ZeroCenteredRMSNorm)
    if post_process and speedups.enabled("positions") and not model_cfg.moe.enabled \
            and not model_cfg.mla.enabled \
            and cuts.mlp_cut_allowed(tcfg, spec):
        spec = cuts.block_spec(spec, tcfg, vp_stage=vp_stage, pp_rank=pg_collection.pp.rank())
    if tcfg.sequence_parallel:
        _memory_buffer()
        if tcfg.transformer_impl == "local":
            spec = sequence_parallel_spec(spec, tcfg, vp_stage=vp_stage,
                                          pp_rank=pg_collection.pp.rank())
    model = RoleModel(
        kind=kind,
        true_vocab=model_cfg.vocab_size,
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tied and kind == "lm",
        position_embedding_type=_position_embedding(model_cfg),
        rotary_base=int(model_cfg.rotary_base),
        rotary_percent=model_cfg.rotary_percent,
        seq_len_interpolation_factor=(model_cfg.rope_scaling.factor
                                      if model_cfg.rope_scaling.type == "linear" else None),
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if model_cfg.rope_scaling.type == "llama3":
        _scale_llama3(model.rotary_pos_emb, model_cfg.rope_scaling)
    if model_cfg.embedding_multiplier != 1.0 and pre_process:
        multiplier = model_cfg.embedding_multiplier  # Gemma: sqrt(hidden), in the dtype
        model.embedding.register_forward_hook(
            lambda module, args, out: out * torch.tensor(multiplier, dtype=out.dtype))
    lora.attach(model, model_cfg)
    if model_cfg.linear_bias and model_cfg.moe.enabled:
        moe.clone_biased_expert_outputs(model)
    if model_cfg.mla.enabled:
        _gather_latents(model)
    if tcfg.params_dtype != torch.float32:
        # Without apex, megatron's local norms (torch.nn.RMSNorm / LayerNorm) are built in
        # fp32 whatever params_dtype says; megatron's own training loop casts the whole
        # model (Float16Module). One dtype for every weight, as the distributed optimizer's
        # fp32 main copies assume (a mixed model breaks its state-dict mapping).
        model.to(tcfg.params_dtype)
    return model


def _memory_buffer() -> None:
    """Sequence parallelism's linears gather the sequence into megatron's global memory
    buffer, which its ``initialize_model_parallel`` (not used: each role has its own
    groups) would create."""
    from megatron.core import parallel_state
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def _gather_latents(model) -> None:
    """Multi-latent attention's down projections are split over TP by rows, and
    megatron-core 0.16.1's MLA gathers their outputs on its global tensor-parallel group,
    which megarlhf's per-role groups do not set (an error at TP > 1). Gathered by the
    layers themselves on their own group, the outputs arrive whole and MLA skips its
    gather. (MLA accepts only megatron's own classes there, so the layers' constructor
    flag is set after construction.)"""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    for module in model.modules():
        if isinstance(module, MLASelfAttention):
            for proj in (getattr(module, "linear_q_down_proj", None),
                         module.linear_kv_down_proj):
                if isinstance(proj, ColumnParallelLinear):
                    proj.gather_output = True


def _position_embedding(model_cfg: ModelConfig) -> str:
    if model_cfg.arch == "gpt2":
        return "learned_absolute"
    if model_cfg.mla.enabled:
        return "none"  # multi-latent attention builds its own rotary embedding
    return "yarn" if model_cfg.rope_scaling.type == "yarn" else "rope"


def _scale_llama3(rope, scaling: RopeScalingConfig) -> None:
    """Llama 3.1's frequency scaling with the config's own values. megatron-core's
    ``rope_scaling=True`` applies the same formula (its ``_apply_scaling``) but passes only
    the factor, keeping low/high frequency factors 1 and 4 and an original context of 8192;
    a model with other values would be silently changed, so the frequencies are scaled here,
    once, before the first forward pass, by that same function."""
    rope.inv_freq = rope._apply_scaling(
        rope.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)


def _param_seed(seed: int, key: str, layer_offsets: tuple) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{layer_offsets}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def _init_rule(key: str, model_cfg: ModelConfig, role: str):
    """(kind, std) for a global parameter name."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "lora_A":  # PEFT's: kaiming-uniform with a = sqrt(5), within 1/sqrt(in)
        return "uniform", 0.0
    if leaf == "lora_B":  # a new adapter adds nothing
        return "zeros", 0.0
    if key.startswith("output_layer") and role == "value":
        if leaf == "bias" or model_cfg.value_head_init == "zero":
            return "zeros", 0.0
        return "normal", 1.0 / math.sqrt(model_cfg.hidden_size + 1)
    if "norm" in key and leaf in ("weight", "layer_norm_weight"):
        return "ones", 0.0
    if leaf in ("bias", "layer_norm_bias") or leaf.endswith("_bias"):
        return "zeros", 0.0
    std = model_cfg.init_method_std
    if key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
        std = std / math.sqrt(2.0 * model_cfg.num_layers)  # GPT-2 / Megatron scaled init
    return "normal", std


def sharded_state_dict(model, prefix: str = "") -> dict:
    """megatron's sharded state dict of one bare chunk, with the chunk's own data-parallel
    group (megatron falls back to its global parallel_state otherwise)."""
    return model.sharded_state_dict(prefix=prefix,
                                    metadata={"dp_cp_group": model.pg_collection.dp_cp})


def _sharded_tensors(model) -> list[ShardedTensor]:
    out = []
    for item in sharded_state_dict(model).values():
        if isinstance(item, ShardedTensorFactory):
            built = item.build()
            items = built.values() if isinstance(built, dict) else built
            out.extend(t for t in items if isinstance(t, ShardedTensor))
        elif isinstance(item, ShardedTensor):
            out.append(item)
    return out


@torch.no_grad()
def init_weights(model, model_cfg: ModelConfig, seed: int) -> None:
    """Seeded initialisation that gives every layout the same global weights.

    Each global tensor (as named by megatron's sharded state dict, with its layer index)
    is drawn from its own generator seeded by (seed, name, layer); this rank copies
    its slice. TP=1, TP=2 and PP=2 therefore hold the same model for one seed.
    """
    role = model.kind
    for st in _sharded_tensors(model):
        if st.data is None or not torch.is_floating_point(st.data):
            continue
        prepend = st.prepend_axis_num
        full = initial_value(st.key, st.global_shape[prepend:], model_cfg, role, seed,
                             tuple(st.global_offset[:prepend]))
        index = tuple(slice(off, off + size)
                      for off, size in zip(st.global_offset[prepend:], st.data.shape))
        st.data.copy_(full[index].to(st.data.dtype))
    _zero_vocab_padding(model)


def initial_value(key: str, full_shape, model_cfg: ModelConfig, role: str, seed: int,
                  layer_offsets: tuple = ()) -> torch.Tensor:
    """The seeded initial value of the global tensor ``key`` (megatron's sharded name;
    ``layer_offsets``: its layer's index in the stacked layers) of an ``lm`` / ``value``
    model."""
    kind, std = _init_rule(key, model_cfg, role)
    if kind == "ones":
        return torch.ones(full_shape)
    if kind == "zeros":
        return torch.zeros(full_shape)
    gen = torch.Generator().manual_seed(_param_seed(seed, key, layer_offsets))
    if kind == "uniform":
        bound = 1.0 / math.sqrt(full_shape[-1])
        return torch.empty(full_shape).uniform_(-bound, bound, generator=gen)
    return torch.empty(full_shape).normal_(0.0, std, generator=gen)


def _zero_vocab_padding(model) -> None:
    """Rows of the padded vocabulary hold zeros (they are masked out of every softmax)."""
    true_vocab = model.true_vocab
    tables = []
    if model.pre_process:
        tables.append(model.embedding.word_embeddings)
    if model.post_process and model.kind == "lm":
        tables.append(model.output_layer)
    for table in tables:
        if table.weight is None:  # tied output layer on the embedding's stage
            continue
        rows = table.weight.shape[0]
        start = rows * table.tp_group.rank()  # both tables split rows evenly over TP
        first_pad = max(0, min(rows, true_vocab - start))
        table.weight[first_pad:].zero_()
